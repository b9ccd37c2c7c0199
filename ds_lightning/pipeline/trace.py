"""Record when each pipeline stage runs each micro-batch, and export the schedule as a Chrome trace and a PNG timeline.

A :class:`SpanRecorder` lives on every rank. The strategy calls :meth:`SpanRecorder.begin_step` once per training
step and wraps each stage's forward / backward call in :meth:`SpanRecorder.span`. After the recorded steps, the
ranks gather :meth:`SpanRecorder.to_payload` (plain tuples), rebuild the spans with
:meth:`SpanRecorder.from_payload` and write them with :func:`write_chrome_trace` (loads in chrome://tracing and
Perfetto) or :func:`render_timeline_png`. :func:`bubble_fraction` measures the idle share of each step.

Start times come from :func:`time.time_ns`, so spans from different processes on one host line up; durations come
from :func:`time.perf_counter_ns`, so a span never has a negative length even if the wall clock is adjusted.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "KINDS",
    "PHASE_KINDS",
    "Span",
    "SpanRecorder",
    "bubble_fraction",
    "chrome_trace",
    "render_timeline_png",
    "write_chrome_trace",
]

KINDS: tuple[str, ...] = ("forward", "backward", "backward_input", "backward_weight")
"""The span kinds, in legend order: full backward, or backward split into input and weight gradients (zero bubble)."""

PHASE_KINDS: tuple[str, ...] = ("data", "compute", "comm", "optimizer")
"""Span kinds for the phases of a whole training step (``DistributedReport``); such spans are named by kind."""

_LETTERS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
_COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "backward_input": "#C44E52",
    "backward_weight": "#55A868",
    "data": "#8172B3",
    "compute": "#4C72B0",
    "comm": "#C44E52",
    "optimizer": "#55A868",
}

Payload = tuple[int, int, str, int, int, int, int]


@dataclass(frozen=True)
class Span:
    """One stage's forward or backward pass on one micro-batch.

    Attributes:
        rank: global rank of the process that ran it.
        stage: pipeline stage index.
        kind: one of :data:`KINDS`, or of :data:`PHASE_KINDS` for a whole step's phase (stage and micro-batch 0).
        microbatch: micro-batch index within the step.
        step: training step (``global_step``) the span belongs to.
        start_ns: :func:`time.time_ns` at the start.
        end_ns: end time in the same clock, ``>= start_ns``.

    """

    rank: int
    stage: int
    kind: str
    microbatch: int
    step: int
    start_ns: int
    end_ns: int

    def __post_init__(self) -> None:
        """Check the kind and that the span does not end before it starts."""
        if self.kind not in KINDS and self.kind not in PHASE_KINDS:
            raise ValueError(f"Span kind={self.kind!r} is unknown; use one of {list(KINDS + PHASE_KINDS)}.")
        if self.end_ns < self.start_ns:
            raise ValueError(f"Span ends before it starts: start_ns={self.start_ns}, end_ns={self.end_ns}.")

    @property
    def duration_ns(self) -> int:
        """Length of the span in nanoseconds."""
        return self.end_ns - self.start_ns


class SpanRecorder:
    """Record the spans of a few training steps on one rank, after skipping warm-up steps.

    Args:
        rank: global rank of this process, stored in every span.
        steps: how many steps to record.
        skip_steps: how many steps to skip first (warm-up: allocation, autotuning, first communication).

    Raises:
        ValueError: if ``steps`` or ``skip_steps`` is negative.

    Example::

        recorder = SpanRecorder(rank=0, steps=2, skip_steps=1)
        for step in range(4):
            recorder.begin_step(step)
            with recorder.span("forward", stage=0, microbatch=0):
                ...

    """

    def __init__(self, rank: int, steps: int = 3, skip_steps: int = 1) -> None:
        if steps < 0:
            raise ValueError(f"SpanRecorder(steps={steps}) must be >= 0, e.g. SpanRecorder(rank, steps=3).")
        if skip_steps < 0:
            raise ValueError(
                f"SpanRecorder(skip_steps={skip_steps}) must be >= 0, e.g. SpanRecorder(rank, skip_steps=1)."
            )
        self.rank = rank
        self.steps = steps
        self.skip_steps = skip_steps
        self._spans: list[Span] = []
        self._seen_steps = 0
        self._recorded_steps = 0
        self._current_step: int | None = None
        self._step = 0
        self._recording = False

    def begin_step(self, step: int) -> None:
        """Start training step ``step`` and decide whether its spans are recorded.

        Calling it again with the current step changes nothing, so a repeated hook does not count a step twice.

        Args:
            step: the training step (``global_step``), stored in the spans.

        """
        if step == self._current_step:
            return
        self._current_step = step
        self._seen_steps += 1
        self._recording = self._seen_steps > self.skip_steps and self._recorded_steps < self.steps
        if self._recording:
            self._recorded_steps += 1
            self._step = step

    @contextmanager
    def span(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        """Time the enclosed block as one span, if the current step is recorded.

        A span is recorded only when the block finishes without an exception.

        Args:
            kind: one of :data:`KINDS`, or of :data:`PHASE_KINDS` for a whole step's phase (stage and micro-batch 0).
            stage: pipeline stage index.
            microbatch: micro-batch index.

        Raises:
            ValueError: if ``kind`` is unknown.

        """
        if not self._recording:
            if kind not in _LETTERS:
                raise ValueError(f"span kind={kind!r} is unknown; use one of {list(KINDS)}.")
            yield
            return
        start_ns = time.time_ns()
        t0 = time.perf_counter_ns()
        yield
        elapsed = time.perf_counter_ns() - t0
        self._spans.append(Span(self.rank, stage, kind, microbatch, self._step, start_ns, start_ns + elapsed))

    @property
    def spans(self) -> list[Span]:
        """The recorded spans, in the order they finished (a copy)."""
        return list(self._spans)

    @property
    def done(self) -> bool:
        """Whether all requested steps have been recorded.

        It turns true when the last recorded step begins, so check it after that step's schedule has run, e.g. in
        ``on_train_batch_end``, then gather :meth:`to_payload`.
        """
        return self._recorded_steps >= self.steps

    def to_payload(self) -> list[Payload]:
        """The spans as plain tuples ``(rank, stage, kind, microbatch, step, start_ns, end_ns)``, to gather."""
        return [(s.rank, s.stage, s.kind, s.microbatch, s.step, s.start_ns, s.end_ns) for s in self._spans]

    @staticmethod
    def from_payload(payload: Iterable[Sequence[Any]]) -> list[Span]:
        """Rebuild spans from :meth:`to_payload` tuples.

        After ``all_gather_object`` the payloads arrive one list per rank; chain them first, e.g.
        ``SpanRecorder.from_payload(itertools.chain.from_iterable(gathered))``.

        Args:
            payload: tuples (or lists) ``(rank, stage, kind, microbatch, step, start_ns, end_ns)``.

        Returns:
            The spans, in payload order.

        Raises:
            ValueError: if an entry does not have seven fields or holds an invalid span.

        """
        spans = []
        for entry in payload:
            if len(entry) != 7:
                raise ValueError(
                    f"payload entry {entry!r} has {len(entry)} fields; expected 7: "
                    "(rank, stage, kind, microbatch, step, start_ns, end_ns). "
                    "Chain per-rank lists first: itertools.chain.from_iterable(gathered)."
                )
            rank, stage, kind, microbatch, step, start_ns, end_ns = entry
            spans.append(Span(int(rank), int(stage), str(kind), int(microbatch), int(step), int(start_ns), int(end_ns)))
        return spans

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, steps={self.steps}, skip_steps={self.skip_steps}, "
            f"recorded_steps={self._recorded_steps}, spans={len(self._spans)})"
        )


def _event_name(span: Span) -> str:
    if span.kind in PHASE_KINDS:
        return span.kind
    return f"{_LETTERS[span.kind]}{span.microbatch}"


def chrome_trace(spans: Iterable[Span]) -> dict[str, Any]:
    """Build a Chrome trace (chrome://tracing, Perfetto) with one process per rank and one thread per stage.

    Each span becomes a complete (``"X"``) event named by kind letter and micro-batch (``F3``, ``B3``, ``I3``,
    ``W3``), or by kind for a whole step's phase (``compute``, on a thread named ``steps``), with ``ts`` and
    ``dur`` in microseconds from the earliest span.

    Args:
        spans: the spans, from any number of ranks and steps.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms"}``: metadata events first, then spans by start time.

    """
    spans = sorted(spans, key=lambda s: (s.start_ns, s.rank, s.stage))
    events: list[dict[str, Any]] = []
    if not spans:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    origin = spans[0].start_ns
    for rank in sorted({s.rank for s in spans}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
    lanes: dict[tuple[int, int], bool] = {}  # (rank, stage) -> it holds only whole-step phases
    for s in spans:
        lanes[(s.rank, s.stage)] = lanes.get((s.rank, s.stage), True) and s.kind in PHASE_KINDS
    for (rank, stage), steps in sorted(lanes.items()):
        name = "steps" if steps else f"stage {stage}"
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": stage, "args": {"name": name}})
    for s in spans:
        events.append(
            {
                "name": _event_name(s),
                "cat": s.kind,
                "ph": "X",
                "pid": s.rank,
                "tid": s.stage,
                "ts": (s.start_ns - origin) / 1000,
                "dur": s.duration_ns / 1000,
                "args": {"step": s.step, "microbatch": s.microbatch, "stage": s.stage, "kind": s.kind},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: Iterable[Span], path: str | os.PathLike[str]) -> Path:
    """Write :func:`chrome_trace` as JSON, creating parent directories.

    Args:
        spans: the spans to export.
        path: destination file, e.g. ``"traces/pipeline.json"``.

    Returns:
        The path written.

    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans)))
    return path


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by the intervals, counting overlaps once."""
    total = 0
    cur_start: int | None = None
    cur_end = 0
    for start, end in sorted(intervals):
        if cur_start is None or start > cur_end:
            if cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_start is not None:
        total += cur_end - cur_start
    return total


def bubble_fraction(spans: Iterable[Span]) -> dict[int, float]:
    """Idle share of each step: ``1 - sum(busy per rank) / (n_ranks * step length)``.

    A step runs from the earliest start to the latest end of its spans. A rank's busy time is the union of its
    spans in that step, so overlapping spans (two stages on one rank) count once. ``n_ranks`` counts every rank
    in ``spans``, so a rank with nothing to do in a step is idle for all of it. A step of zero length has a
    bubble of ``0.0``.

    Args:
        spans: spans of one or more steps, from all ranks.

    Returns:
        ``{step: fraction}`` in step order; empty when there are no spans.

    """
    spans = list(spans)
    n_ranks = len({s.rank for s in spans})
    by_step: dict[int, dict[int, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for s in spans:
        by_step[s.step][s.rank].append((s.start_ns, s.end_ns))
    result = {}
    for step in sorted(by_step):
        per_rank = by_step[step]
        start = min(a for intervals in per_rank.values() for a, _ in intervals)
        end = max(b for intervals in per_rank.values() for _, b in intervals)
        capacity = n_ranks * (end - start)
        if capacity == 0:
            result[step] = 0.0
            continue
        busy = sum(_union_ns(intervals) for intervals in per_rank.values())
        result[step] = (capacity - busy) / capacity
    return result


def render_timeline_png(spans: Iterable[Span], path: str | os.PathLike[str], title: str | None = None) -> Path:
    """Draw the spans as a timeline, one lane per rank, and write it as a PNG.

    Bars are coloured by kind and labelled with their micro-batch index where wide enough; dotted lines mark the
    start of each step. Uses matplotlib's Agg canvas directly, so the global backend is left alone.

    Args:
        spans: the spans to draw.
        path: destination PNG file; parent directories are created.
        title: figure title; defaults to ``"pipeline schedule"``.

    Returns:
        The path written.

    Raises:
        ImportError: if matplotlib is not installed.
        ValueError: if there are no spans.

    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("render_timeline_png needs matplotlib: pip install matplotlib") from err

    spans = sorted(spans, key=lambda s: (s.start_ns, s.rank, s.stage))
    if not spans:
        raise ValueError("render_timeline_png got no spans; record at least one step (SpanRecorder(steps>=1)).")
    origin = spans[0].start_ns
    ranks = sorted({s.rank for s in spans})
    lane = {rank: i for i, rank in enumerate(ranks)}
    total_ms = max((s.end_ns - origin) / 1e6 for s in spans) or 1e-6
    min_label_ms = total_ms / 60

    fig = Figure(figsize=(max(8.0, min(24.0, 0.25 * len(spans) / len(ranks) + 6)), 1.0 + 0.6 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in spans:
        left = (s.start_ns - origin) / 1e6
        width = s.duration_ns / 1e6
        y = lane[s.rank]
        ax.barh(y, width, left=left, height=0.8, color=_COLOURS[s.kind], edgecolor="black", linewidth=0.4)
        if width >= min_label_ms and s.kind in _LETTERS:
            ax.text(left + width / 2, y, str(s.microbatch), ha="center", va="center", fontsize=7, color="white")
    step_starts: dict[int, int] = {}
    for s in spans:
        step_starts[s.step] = min(step_starts.get(s.step, s.start_ns), s.start_ns)
    for start in sorted(step_starts.values())[1:]:
        ax.axvline((start - origin) / 1e6, color="grey", linestyle=":", linewidth=0.8)

    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {rank}" for rank in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, total_ms)
    ax.set_xlabel("time (ms)")
    ax.set_title(title if title is not None else "pipeline schedule")
    present = [kind for kind in KINDS + PHASE_KINDS if any(s.kind == kind for s in spans)]
    ax.legend(
        handles=[Patch(color=_COLOURS[kind], label=kind) for kind in present],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()

    from PIL import Image  # matplotlib's own dependency

    # A timeline holds a handful of flat colours, so a 32-colour palette looks the same at about a quarter of the
    # bytes of matplotlib's RGBA file (these PNGs are committed with the benchmark results).
    rgba = io.BytesIO()
    fig.savefig(rgba, format="png", dpi=120)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(rgba) as image:
        palette = image.convert("RGB").quantize(colors=32, method=Image.Quantize.MEDIANCUT)
    palette.save(path, "PNG", optimize=True)
    return path
