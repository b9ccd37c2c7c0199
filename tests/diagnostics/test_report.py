"""The step clock, the payload counter, the verdict rule and the report's table, JSON, PNG and trace, in one process."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from ds_lightning.diagnostics import PayloadCounter, RankSummary, StepClock, StepTime, verdict
from ds_lightning.diagnostics.payload_bytes import _collective, payload_nbytes
from ds_lightning.diagnostics.report import format_table, phase_spans, render_steps_png, report_dict, transfer_ms
from ds_lightning.pipeline.trace import chrome_trace
from ds_lightning.testing.processes import free_port

MS = 1_000_000


def _summary(rank: int, data: float, compute: float, comm: float, optimizer: float = 0.1) -> RankSummary:
    steps = [StepTime(i, 0, int(data * MS), int(compute * MS), int(comm * MS), int(optimizer * MS)) for i in range(5)]
    return RankSummary.of(rank, steps, payload_sent=100, payload_received=100)


def test_the_rank_the_others_wait_for_is_the_compute_bound_straggler():
    # Rank 2 computes 30 ms more; ranks 0, 1 and 3 wait that long in the all-reduce for it.
    ranks = [_summary(0, 1, 5, 31), _summary(1, 1, 5, 30), _summary(2, 1, 35, 1), _summary(3, 1, 6, 30)]
    found = verdict(ranks)
    assert (found.straggler, found.bound) == (2, "compute-bound")
    assert "mostly compute" in found.reason and "rank 2" in found.reason


def test_slow_data_loading_is_named_as_the_excess():
    found = verdict([_summary(0, 20, 5, 1), _summary(1, 1, 5, 20)])
    assert (found.straggler, found.bound) == (0, "compute-bound")
    assert "mostly data loading" in found.reason


def test_equal_work_and_short_waits_is_balanced():
    found = verdict([_summary(0, 1, 20, 1), _summary(1, 1, 20.5, 0.6)])
    assert (found.straggler, found.bound) == (None, "balanced")


def test_equal_work_and_long_waits_on_every_rank_is_link_bound_naming_no_rank():
    found = verdict([_summary(0, 1, 10, 20), _summary(1, 1, 10, 20.2), _summary(2, 1, 10.2, 19.9)])
    assert (found.straggler, found.bound) == (None, "link-bound")
    assert "the links" in found.reason


def test_one_rank_waiting_far_longer_with_equal_work_is_named_link_bound():
    found = verdict([_summary(0, 1, 10, 30), _summary(1, 1, 10, 5), _summary(2, 1, 10, 5)])
    assert (found.straggler, found.bound) == (0, "link-bound")


def test_ranks_waiting_for_each_other_in_turn_is_jitter_not_the_link():
    # Each step one rank arrives late and the other waits 3 ms for it; the last to arrive waits only 0.1 ms.
    waits = {0: [3.0, 0.1] * 5, 1: [0.1, 3.0] * 5}
    steps = {r: [StepTime(i, 0, 0, 4 * MS, int(w * MS), 0) for i, w in enumerate(ws)] for r, ws in waits.items()}
    assert transfer_ms(steps) == pytest.approx(0.1)
    ranks = [RankSummary.of(r, s) for r, s in steps.items()]
    assert verdict(ranks).bound == "link-bound"  # judged on each rank's median wait alone
    assert verdict(ranks, transfer=transfer_ms(steps)).bound == "balanced"


def test_one_rank_has_no_straggler():
    assert verdict([_summary(0, 1, 10, 0)]).straggler is None


def test_medians_ignore_one_slow_step():
    steps = [StepTime(i, 0, 0, 5 * MS, 0, 0) for i in range(9)] + [StepTime(9, 0, 0, 500 * MS, 0, 0)]
    assert RankSummary.of(0, steps).compute_ms == pytest.approx(5.0)


def test_the_clock_splits_compute_from_the_wait_after_the_last_gradient():
    model = torch.nn.Linear(4, 2)
    clock = StepClock()
    clock.watch(model)
    clock.pause()
    time.sleep(0.01)  # data
    clock.batch_start()
    clock.batch_start()  # a second callback on the same clock: no effect
    loss = model(torch.randn(3, 4)).sum()
    time.sleep(0.02)  # forward
    clock.backward_start()
    loss.backward()
    time.sleep(0.03)  # as if DDP waited for the other ranks before backward returns
    clock.backward_end()
    clock.optimizer_start()
    time.sleep(0.005)
    step = clock.batch_end()
    assert clock.batch_end() is None  # closed once
    assert step is not None and step is clock.last
    assert 0.009 < step.data_ns / 1e9 < 0.03
    assert 0.019 < step.compute_ns / 1e9 < 0.03
    assert 0.029 < step.comm_ns / 1e9 < 0.05
    assert 0.004 < step.optimizer_ns / 1e9 < 0.02
    assert step.busy_ns == step.total_ns - step.comm_ns
    clock.unwatch()
    clock.batch_start()
    clock.backward_start()
    model(torch.randn(3, 4)).sum().backward()
    time.sleep(0.01)
    clock.backward_end()
    unhooked = clock.batch_end()
    assert unhooked is not None and unhooked.comm_ns == 0  # no gradient time: all compute


class _Loop:
    """Stands in for Lightning's training epoch loop: the broadcast before each batch, here a 30 ms wait."""

    def _broadcast_sigterm_tensor(self) -> None:
        time.sleep(0.03)


def test_the_broadcast_before_a_batch_is_communication_not_data():
    loop, clock = _Loop(), StepClock()
    clock.watch_loop(loop)
    clock.pause()
    loop._broadcast_sigterm_tensor()  # as Lightning calls it, before fetching the batch
    time.sleep(0.01)  # data
    clock.batch_start()
    step = clock.batch_end()
    assert step is not None
    # Lower bounds only (a loaded machine stretches sleeps): the step has no backward pass, so its only comm is the
    # broadcast, and counted as data it would leave comm at 0.
    assert step.data_ns / 1e9 > 0.009 and step.comm_ns / 1e9 > 0.029 and step.sync_ns == step.comm_ns
    clock.unwatch_loop()
    assert "_broadcast_sigterm_tensor" not in vars(loop)  # Lightning's own method again
    loop._broadcast_sigterm_tensor()
    clock.batch_start()
    unwatched = clock.batch_end()
    assert unwatched is not None and unwatched.comm_ns == 0 and unwatched.data_ns > 0.029e9  # the control


def test_payload_sizes_follow_dtype_and_direction():
    assert payload_nbytes([[4, 3], [2]], ["Float", "BFloat16"]) == 4 * 3 * 4 + 2 * 2
    base = {"record_id": 1, "time_created_ns": 5, "process_group": ("0", "default_pg")}
    sizes = {"input_sizes": [[10]], "input_dtypes": ["Float"], "output_sizes": [[10]], "output_dtypes": ["Float"]}
    reduce = _collective({**base, **sizes, "profiling_name": "gloo:all_reduce"})
    send = _collective({**base, **sizes, "profiling_name": "gloo:send"})
    recv = _collective({**base, **sizes, "profiling_name": "gloo:recv"})
    assert (reduce.sent, reduce.received, reduce.group) == (40, 40, "default_pg")
    assert (send.sent, send.received) == (40, 0)
    assert (recv.sent, recv.received) == (0, 40)


def test_the_counter_reads_the_flight_recorder_once_per_entry(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(3))  # before start: set-up traffic, not counted
        counter = PayloadCounter()
        counter.start()
        dist.all_reduce(torch.ones(10))
        dist.all_reduce(torch.ones(5, dtype=torch.bfloat16))
        fresh = counter.poll(steps_since_poll=2)
        assert [c.name for c in fresh] == ["gloo:all_reduce", "gloo:all_reduce"]
        assert (counter.sent, counter.received, counter.lost) == (50, 50, 0)
        assert counter.poll() == [] and counter.sent == 50  # nothing new: nothing counted twice
        assert not counter.due(10) and counter.due(1000)  # one entry a step: poll when half the ring may be new
    finally:
        dist.destroy_process_group()


def test_table_json_png_and_trace(tmp_path):
    steps = {
        0: [StepTime(i, 1_000 * MS + i * 10 * MS, MS, 2 * MS, 6 * MS, MS) for i in range(4)],
        1: [StepTime(i, 1_000 * MS + i * 10 * MS, MS, 8 * MS, 0, MS) for i in range(4)],
    }
    ranks = [RankSummary.of(r, s, payload_sent=2_000_000, payload_received=2_000_000) for r, s in steps.items()]
    found = verdict(ranks)
    table = format_table(ranks, found, warmup_steps=2)
    assert "rank 1 is the straggler, compute-bound" in table
    assert table.splitlines()[2].split()[:6] == ["0", "1.00", "2.00", "6.00", "1.00", "10.00"]
    document = json.loads(json.dumps(report_dict(ranks, found, steps, {"strategy": "ds_mirrored"})))
    assert document["verdict"]["straggler"] == 1 and document["ranks"][1]["payload_sent"] == 2_000_000
    assert document["steps"]["1"][0] == [0, 1.0, 8.0, 0.0, 1.0]
    png = render_steps_png(steps, tmp_path / "report.png", "title")
    assert png.read_bytes()[:4] == b"\x89PNG"
    events = chrome_trace([span for r, s in steps.items() for span in phase_spans(r, s)])["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}  # one track per rank
    assert [e["name"] for e in spans if e["pid"] == 0][:4] == ["data", "compute", "comm", "optimizer"]
    # A wait before the batch (Lightning's broadcast) is drawn where it happened: before the data, ending where the
    # step's data phase starts, so the step's spans tile it without a gap or an overlap.
    waited = StepTime(0, 1_000 * MS, MS, 2 * MS, 6 * MS, MS, sync_ns=4 * MS)
    drawn = phase_spans(0, [waited])
    assert [(x.kind, x.start_ns, x.end_ns) for x in drawn] == [
        ("comm", 995 * MS, 999 * MS),
        ("data", 999 * MS, 1_000 * MS),
        ("compute", 1_000 * MS, 1_002 * MS),
        ("comm", 1_002 * MS, 1_004 * MS),
        ("optimizer", 1_004 * MS, 1_005 * MS),
    ]
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"steps"}
