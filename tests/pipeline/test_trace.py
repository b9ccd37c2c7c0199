"""Span recording, Chrome-trace export, bubble fraction and PNG timeline of pipeline schedules."""

from __future__ import annotations

import itertools
import json
import sys
import time
from fractions import Fraction

import pytest

from ds_lightning.pipeline.trace import (
    Span,
    SpanRecorder,
    bubble_fraction,
    chrome_trace,
    render_timeline_png,
    write_chrome_trace,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _span(rank, start, end, kind="forward", stage=None, microbatch=0, step=0):
    return Span(
        rank=rank,
        stage=rank if stage is None else stage,
        kind=kind,
        microbatch=microbatch,
        step=step,
        start_ns=start,
        end_ns=end,
    )


def _run_steps(recorder, steps):
    for step in steps:
        recorder.begin_step(step)
        for mb in range(2):
            with recorder.span("forward", stage=0, microbatch=mb):
                pass
        with recorder.span("backward", stage=0, microbatch=0):
            pass


# --- recorder ---------------------------------------------------------------------------------------------------


def test_recorder_skips_warmup_and_stops_after_requested_steps():
    recorder = SpanRecorder(rank=3, steps=2, skip_steps=1)
    assert not recorder.done
    _run_steps(recorder, [10])
    assert recorder.spans == []
    assert not recorder.done
    _run_steps(recorder, [11, 12])
    assert recorder.done
    _run_steps(recorder, [13, 14])
    spans = recorder.spans
    assert [s.step for s in spans] == [11, 11, 11, 12, 12, 12]
    assert [(s.kind, s.microbatch) for s in spans[:3]] == [("forward", 0), ("forward", 1), ("backward", 0)]
    assert {s.rank for s in spans} == {3}
    assert {s.stage for s in spans} == {0}


def test_recorder_counts_a_repeated_begin_step_once():
    recorder = SpanRecorder(rank=0, steps=1, skip_steps=1)
    recorder.begin_step(0)
    recorder.begin_step(0)
    with recorder.span("forward", 0, 0):
        pass
    assert recorder.spans == []
    recorder.begin_step(1)
    with recorder.span("forward", 0, 0):
        pass
    assert [s.step for s in recorder.spans] == [1]


def test_recorder_records_nothing_before_first_step_or_with_zero_steps():
    recorder = SpanRecorder(rank=0, steps=1, skip_steps=0)
    with recorder.span("forward", 0, 0):
        pass
    assert recorder.spans == []
    zero = SpanRecorder(rank=0, steps=0, skip_steps=0)
    assert zero.done
    _run_steps(zero, [0, 1])
    assert zero.spans == []


def test_recorder_without_skip_records_first_step():
    recorder = SpanRecorder(rank=0, steps=1, skip_steps=0)
    _run_steps(recorder, [0, 1])
    assert {s.step for s in recorder.spans} == {0}
    assert len(recorder.spans) == 3


def test_span_timing_is_non_negative_and_ordered():
    recorder = SpanRecorder(rank=0, steps=1, skip_steps=0)
    recorder.begin_step(0)
    before = time.time_ns()
    with recorder.span("forward", 0, 0):
        time.sleep(0.002)
    time.sleep(0.002)
    with recorder.span("backward", 0, 0):
        pass
    first, second = recorder.spans
    assert first.start_ns >= before
    assert first.end_ns - first.start_ns >= 2_000_000
    assert second.end_ns >= second.start_ns
    assert second.start_ns >= first.end_ns


def test_span_is_not_recorded_when_the_block_raises():
    recorder = SpanRecorder(rank=0, steps=1, skip_steps=0)
    recorder.begin_step(0)
    with pytest.raises(RuntimeError), recorder.span("forward", 0, 0):
        raise RuntimeError("boom")
    assert recorder.spans == []


def test_spans_property_returns_a_copy():
    recorder = SpanRecorder(rank=0, steps=1, skip_steps=0)
    _run_steps(recorder, [0])
    recorder.spans.clear()
    assert len(recorder.spans) == 3


@pytest.mark.parametrize(("kwargs", "message"), [({"steps": -1}, "steps=-1"), ({"skip_steps": -2}, "skip_steps=-2")])
def test_recorder_rejects_negative_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpanRecorder(rank=0, **kwargs)


@pytest.mark.parametrize("recording", [True, False])
def test_unknown_kind_is_rejected_whether_recording_or_not(recording):
    recorder = SpanRecorder(rank=0, steps=1, skip_steps=0 if recording else 5)
    recorder.begin_step(0)
    with pytest.raises(ValueError, match="'fwd'"), recorder.span("fwd", 0, 0):
        pass


def test_span_rejects_bad_kind_and_negative_duration():
    with pytest.raises(ValueError, match="'fwd'"):
        _span(0, 0, 1, kind="fwd")
    with pytest.raises(ValueError, match="start_ns=5, end_ns=4"):
        _span(0, 5, 4)


def test_payload_round_trip_across_ranks():
    recorders = [SpanRecorder(rank=r, steps=1, skip_steps=0) for r in range(2)]
    for recorder in recorders:
        _run_steps(recorder, [7])
    gathered = [recorder.to_payload() for recorder in recorders]
    assert all(type(entry) is tuple for entry in gathered[0])
    assert gathered[1][0][:5] == (1, 0, "forward", 0, 7)
    # all_gather_object may hand back lists instead of tuples
    as_lists = [[list(entry) for entry in payload] for payload in gathered]
    rebuilt = SpanRecorder.from_payload(itertools.chain.from_iterable(as_lists))
    assert rebuilt == recorders[0].spans + recorders[1].spans


def test_from_payload_names_the_fix_for_nested_lists():
    with pytest.raises(ValueError, match=r"chain\.from_iterable"):
        SpanRecorder.from_payload([[(0, 0, "forward", 0, 0, 0, 1)]])


# --- chrome trace -----------------------------------------------------------------------------------------------


def _trace_spans():
    return [
        _span(1, 3_500_000, 4_000_000, kind="backward", stage=1, microbatch=0, step=2),
        _span(0, 1_000_000, 2_000_000, kind="forward", stage=0, microbatch=3, step=2),
        _span(1, 2_250_000, 3_000_000, kind="backward_input", stage=1, microbatch=1, step=2),
        _span(1, 3_000_000, 3_000_500, kind="backward_weight", stage=1, microbatch=1, step=2),
    ]


def test_chrome_trace_has_metadata_and_complete_events():
    trace = chrome_trace(_trace_spans())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    assert {(e["name"], e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"} == {
        ("process_name", 0, "rank 0"),
        ("process_name", 1, "rank 1"),
    }
    assert {(e["pid"], e["tid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"} == {
        (0, 0, "stage 0"),
        (1, 1, "stage 1"),
    }
    assert len(meta) == 4

    spans = [e for e in events if e["ph"] != "M"]
    assert all(e["ph"] == "X" for e in spans)
    by_name = {e["name"]: e for e in spans}
    assert set(by_name) == {"F3", "B0", "I1", "W1"}
    f3 = by_name["F3"]
    assert (f3["pid"], f3["tid"], f3["ts"], f3["dur"], f3["cat"]) == (0, 0, 0, 1000, "forward")
    assert f3["args"] == {"step": 2, "microbatch": 3, "stage": 0, "kind": "forward"}
    b0 = by_name["B0"]
    assert (b0["pid"], b0["tid"], b0["ts"], b0["dur"], b0["cat"]) == (1, 1, 2500, 500, "backward")
    i1 = by_name["I1"]
    assert (i1["ts"], i1["dur"], i1["cat"]) == (1250, 750, "backward_input")
    w1 = by_name["W1"]
    assert (w1["ts"], w1["dur"], w1["cat"]) == (2000, 0.5, "backward_weight")
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)


def test_chrome_trace_of_no_spans_is_empty():
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}


def test_write_chrome_trace_creates_dirs_and_loads_back(tmp_path):
    target = tmp_path / "nested" / "dir" / "trace.json"
    written = write_chrome_trace(iter(_trace_spans()), str(target))
    assert written == target
    assert json.loads(target.read_text()) == chrome_trace(_trace_spans())


# --- bubble fraction --------------------------------------------------------------------------------------------


def test_bubble_fraction_exact_on_two_ranks():
    spans = [
        _span(0, 0, 40, microbatch=0),
        _span(0, 60, 100, kind="backward", microbatch=0),
        _span(1, 20, 80, microbatch=0),
    ]
    # step lasts 100 ns on 2 ranks = 200; busy 80 + 60 = 140; idle 60
    result = bubble_fraction(spans)
    assert result == {0: float(Fraction(60, 200))}
    assert result[0] == 0.3


def test_bubble_fraction_does_not_double_count_overlaps():
    spans = [
        _span(0, 0, 60, stage=0),
        _span(0, 40, 100, stage=2),  # overlaps the first: union is [0, 100]
        _span(0, 10, 20, stage=2, kind="backward"),  # inside the first
        _span(1, 0, 50, stage=1),
    ]
    # busy 100 + 50 = 150 of 200; double counting would give 180 of 200
    assert bubble_fraction(spans) == {0: 0.25}


def test_bubble_fraction_per_step_counts_absent_rank_as_idle():
    spans = [
        _span(0, 0, 100, step=1),
        _span(1, 0, 100, step=1),
        _span(0, 200, 250, step=2),
        _span(0, 250, 300, step=2, kind="backward"),
        _span(0, 0, 10, step=0),
        _span(1, 30, 40, step=0),
    ]
    # step 2: rank 1 does nothing, so half the capacity is idle; step 0: 20 busy of 2 * 40
    assert bubble_fraction(spans) == {0: 0.75, 1: 0.0, 2: 0.5}
    assert list(bubble_fraction(spans)) == [0, 1, 2]


def test_bubble_fraction_of_nothing_and_of_zero_length_step():
    assert bubble_fraction([]) == {}
    assert bubble_fraction([_span(0, 5, 5)]) == {0: 0.0}


# --- PNG timeline -----------------------------------------------------------------------------------------------


def test_render_timeline_png_writes_a_png(tmp_path):
    recorder = SpanRecorder(rank=0, steps=2, skip_steps=0)
    _run_steps(recorder, [0, 1])
    spans = recorder.spans + _trace_spans()
    target = tmp_path / "out" / "timeline.png"
    written = render_timeline_png(spans, target, title="1F1B, 2 stages")
    assert written == target
    data = target.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1000
    from PIL import Image

    with Image.open(target) as image:  # a palette PNG: the committed benchmark traces stay small
        assert image.mode == "P"


def test_render_timeline_png_leaves_the_global_backend_alone(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    render_timeline_png(_trace_spans(), tmp_path / "t.png")
    assert matplotlib.get_backend() == backend


def test_render_timeline_png_rejects_no_spans(tmp_path):
    with pytest.raises(ValueError, match="no spans"):
        render_timeline_png([], tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_render_timeline_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.backends", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        render_timeline_png(_trace_spans(), tmp_path / "t.png")


@pytest.mark.multiprocess
def test_importing_trace_does_not_import_matplotlib():
    import subprocess

    import ds_lightning.pipeline.trace as trace

    # load the module file alone: the rest of the package (Lightning) may import matplotlib itself
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('trace_alone', {trace.__file__!r})\n"
        "module = sys.modules['trace_alone'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print('matplotlib' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
