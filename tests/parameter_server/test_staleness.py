"""Staleness clock (SSP/BSP bounds on simulated schedules), staleness stats, LR factor and BSP accumulation."""

from __future__ import annotations

import heapq
import random

import pytest
import torch

from ds_lightning.parameter_server.staleness import (
    STALENESS_BINS,
    StalenessClock,
    StalenessStats,
    SyncAccumulator,
    staleness_lr_factor,
)


def simulate(clock: StalenessClock, durations: list[float], steps: int, seed: int, die: dict[int, float] | None = None):
    """Event-driven run: workers start when ``may_start`` allows, finish after a jittered duration, then tick.

    ``die`` maps a worker to the time it dies (it never pushes again and is marked dead then).
    Returns a trace: per worker the list of (step index, start time); the largest live gap seen at start times
    (clock[w] - min live clock when w starts); and the largest live clock gap seen at any time.
    """
    rng = random.Random(seed)
    n = clock.num_workers
    die = dict(die or {})
    now = 0.0
    running: dict[int, float] = {}
    starts: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    events: list[tuple[float, int, str]] = [(t, w, "die") for w, t in die.items()]
    heapq.heapify(events)
    max_start_gap = 0
    max_gap = 0

    def try_start() -> None:
        nonlocal max_start_gap
        for w in clock.live_workers:
            if w in running or clock.clocks[w] >= steps or not clock.may_start(w):
                continue
            max_start_gap = max(max_start_gap, clock.clocks[w] - clock.min_clock)
            starts[w].append((clock.clocks[w], now))
            running[w] = now
            heapq.heappush(events, (now + durations[w] * rng.uniform(0.5, 1.5), w, "done"))

    try_start()
    while events:
        now, w, kind = heapq.heappop(events)
        if w not in clock.live_workers:
            continue
        if kind == "die":
            running.pop(w, None)
            clock.mark_dead(w)
        else:
            del running[w]
            if clock.tick(w) == steps:
                clock.mark_finished(w)
        max_gap = max(max_gap, clock.gap)
        try_start()
    return starts, max_start_gap, max_gap


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_ssp_bound_holds_and_is_reached_on_random_schedules(k, seed):
    rng = random.Random(100 + seed)
    durations = [rng.uniform(0.2, 3.0) for _ in range(4)] + [5.0]  # one clearly slow worker
    clock = StalenessClock(5, k)
    starts, max_start_gap, max_gap = simulate(clock, durations, steps=30, seed=seed)
    assert max_start_gap == k  # never exceeded, and the slow worker makes the bound bind
    assert max_gap <= k + 1  # a finished step may put a waiting worker one clock further ahead
    assert clock.clocks == (30,) * 5  # no deadlock: everyone finished
    assert clock.live_workers == ()
    assert all([s for s, _ in trace] == list(range(30)) for trace in starts)


def test_without_bound_a_slow_worker_falls_arbitrarily_far_behind():
    clock = StalenessClock(3, None)
    _, max_start_gap, max_gap = simulate(clock, [0.2, 0.3, 5.0], steps=60, seed=0)
    assert max_start_gap > 20
    assert max_gap > 20
    assert clock.clocks == (60, 60, 60)


def test_simulation_detects_a_clock_that_ignores_the_bound():
    class Broken(StalenessClock):
        def may_start(self, worker: int) -> bool:
            return True

    _, max_start_gap, _ = simulate(Broken(3, 1), [0.2, 0.3, 5.0], steps=30, seed=0)
    assert max_start_gap > 1


def test_bulk_synchronous_releases_all_workers_together():
    clock = StalenessClock(4, 0)
    starts, max_start_gap, max_gap = simulate(clock, [0.5, 1.0, 2.0, 4.0], steps=10, seed=3)
    assert max_start_gap == 0
    assert max_gap == 1
    for step in range(10):
        times = {t for trace in starts for s, t in trace if s == step}
        assert len(times) == 1, f"step {step} started at {sorted(times)}"
    # step s starts exactly when the last worker finished step s - 1, i.e. after everybody's previous start
    step_start = [next(t for s, t in starts[0] if s == step) for step in range(10)]
    assert step_start == sorted(step_start) and len(set(step_start)) == 10


def test_bsp_barrier_by_hand():
    clock = StalenessClock(3, 0)
    assert all(clock.may_start(w) for w in range(3))
    assert clock.tick(0) == 1
    assert not clock.may_start(0)
    assert clock.may_start(1) and clock.may_start(2)  # still behind: they are in their step 0
    clock.tick(1)
    assert not clock.may_start(0) and not clock.may_start(1)
    clock.tick(2)
    assert all(clock.may_start(w) for w in range(3))


def test_dead_worker_stops_holding_others_back():
    clock = StalenessClock(3, 1)
    for _ in range(2):
        clock.tick(0)
        clock.tick(1)
    assert clock.slowest == 2 and clock.min_clock == 0
    assert not clock.may_start(0) and not clock.may_start(1)
    clock.mark_dead(2)
    assert clock.live_workers == (0, 1)
    assert clock.dead_workers == (2,)
    assert clock.may_start(0) and clock.may_start(1)
    assert clock.gap == 0
    with pytest.raises(RuntimeError, match="worker 2 cannot tick: it was marked dead"):
        clock.tick(2)
    with pytest.raises(RuntimeError, match="marked dead and cannot be marked finished"):
        clock.mark_finished(2)


def test_dead_worker_in_simulation_unblocks_the_rest():
    clock = StalenessClock(3, 1)
    starts, max_start_gap, _ = simulate(clock, [1.0, 1.0, 1.0], steps=20, seed=5, die={2: 4.2})
    assert clock.dead_workers == (2,)
    assert clock.finished_workers == (0, 1)
    assert clock.clocks[0] == clock.clocks[1] == 20
    assert clock.clocks[2] < 20
    assert max_start_gap <= 1
    assert [len(trace) for trace in starts[:2]] == [20, 20]
    assert max(t for _, t in starts[2]) < 4.2 < max(t for _, t in starts[0])


def test_finished_worker_stops_holding_others_back_and_stays_finished():
    clock = StalenessClock(2, 0)
    clock.tick(0)
    assert not clock.may_start(0)
    clock.mark_finished(1)
    assert clock.may_start(0)
    clock.mark_dead(1)  # exiting after finishing is normal
    assert clock.finished_workers == (1,) and clock.dead_workers == ()
    with pytest.raises(RuntimeError, match="marked finished"):
        clock.may_start(1)


def test_no_live_workers():
    clock = StalenessClock(2, 2)
    clock.mark_dead(0)
    clock.mark_finished(1)
    assert clock.live_workers == ()
    assert clock.slowest is None and clock.min_clock is None and clock.gap == 0


def test_clock_state_dict_round_trips_through_tensors(tmp_path):
    clock = StalenessClock(4, 2)
    for w, n in [(0, 3), (1, 1), (2, 2), (3, 1)]:
        for _ in range(n):
            clock.tick(w)
    clock.mark_dead(1)
    clock.mark_finished(3)
    state = clock.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    torch.save(state, tmp_path / "clock.pt")
    restored = StalenessClock(4, 2)
    restored.load_state_dict(torch.load(tmp_path / "clock.pt", weights_only=True))
    assert restored.clocks == (3, 1, 2, 1)
    assert restored.live_workers == (0, 2)
    assert restored.dead_workers == (1,) and restored.finished_workers == (3,)
    assert restored.may_start(2) and restored.may_start(0)
    with pytest.raises(ValueError, match="holds 4 workers, but this clock has num_workers=3"):
        StalenessClock(3, 2).load_state_dict(state)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1), "num_workers=0 must be an integer >= 1"),
        ((True, 1), "num_workers=True"),
        ((2, -1), r"max_staleness=-1 is invalid; use None \(fully asynchronous\), 0"),
        ((2, 1.5), "max_staleness=1.5 is invalid"),
    ],
)
def test_bad_clock_arguments_name_the_value(args, message):
    with pytest.raises(ValueError, match=message):
        StalenessClock(*args)


def test_bad_worker_index_names_the_range():
    clock = StalenessClock(3, None)
    with pytest.raises(ValueError, match=r"worker=3 is not a worker index; use an integer in 0\.\.2"):
        clock.tick(3)
    with pytest.raises(ValueError, match="worker=-1"):
        clock.may_start(-1)


@pytest.mark.parametrize(
    ("staleness", "rule", "factor"),
    [
        (0, "none", 1.0),
        (7, "none", 1.0),
        (0, "inverse", 1.0),
        (1, "inverse", 1.0),
        (2, "inverse", 0.5),
        (8, "inverse", 0.125),
    ],
)
def test_staleness_lr_factor(staleness, rule, factor):
    assert staleness_lr_factor(staleness, rule) == factor


def test_staleness_lr_factor_errors():
    with pytest.raises(
        ValueError, match=r"staleness_lr='linear' is not supported; choose one of \['none', 'inverse'\]"
    ):
        staleness_lr_factor(1, "linear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staleness=-1 must be an integer >= 0"):
        staleness_lr_factor(-1, "inverse")


def test_stats_mean_max_histogram_exact():
    stats = StalenessStats()
    for s in [0, 0, 1, 2, 3, 4, 7, 8, 15, 16, 100]:
        stats.record(s)
    assert stats.count == 11
    assert stats.mean == 156 / 11
    assert stats.max == 100
    assert stats.histogram == [2, 1, 2, 2, 2, 2]
    assert len(stats.histogram) == len(STALENESS_BINS)
    logged = stats.as_dict()
    assert logged["staleness/mean"] == 156 / 11 and logged["staleness/max"] == 100.0
    assert logged["staleness/bin_16+"] == 2.0 and logged["staleness/bin_2-3"] == 2.0
    stats.reset()
    assert (stats.count, stats.mean, stats.max, stats.histogram) == (0, 0.0, 0, [0] * 6)


def test_stats_tensor_round_trip_and_merge():
    a, b = StalenessStats(), StalenessStats()
    for s in [0, 1, 5]:
        a.record(s)
    for s in [2, 20]:
        b.record(s)
    tensor = a.to_tensor()
    assert tensor.dtype == torch.int64
    assert tensor.tolist() == [3, 6, 5, 1, 1, 0, 1, 0, 0]
    restored = StalenessStats.from_tensor(tensor)
    assert restored.to_tensor().tolist() == tensor.tolist()
    gathered = [StalenessStats.from_tensor(t) for t in torch.stack([a.to_tensor(), b.to_tensor()])]
    gathered[0].merge(gathered[1])
    assert gathered[0].to_tensor().tolist() == [5, 28, 20, 1, 1, 1, 1, 0, 1]
    assert gathered[0].mean == 28 / 5
    with pytest.raises(ValueError, match=r"shape \(4,\); expected \(9,\)"):
        StalenessStats.from_tensor(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="staleness=-2"):
        a.record(-2)


def test_sync_accumulator_averages_exactly_once_per_worker():
    acc = SyncAccumulator(3)
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([4.0, -2.0]), torch.tensor([7.0, 3.0])]
    for w in (2, 0):
        acc.push(w, grads[w], version=0)
        assert not acc.ready()
    assert acc.missing == (1,)
    with pytest.raises(RuntimeError, match=r"waiting for workers \[1\]"):
        acc.mean()
    with pytest.raises(RuntimeError, match="would drop gradients"):
        acc.advance()
    acc.push(1, grads[1], version=0)
    assert acc.ready()
    assert torch.equal(acc.mean(), torch.tensor([4.0, 1.0]))
    assert acc.contributors == (2, 0, 1)
    assert torch.equal(grads[2], torch.tensor([7.0, 3.0]))  # inputs untouched
    assert acc.advance() == 1
    assert not acc.ready() and acc.missing == (0, 1, 2)
    with pytest.raises(ValueError, match="version 0, but version 1 is being collected"):
        acc.push(0, grads[0], version=0)


def test_sync_accumulator_refuses_a_second_push_from_the_same_worker():
    acc = SyncAccumulator(2, version=5)
    acc.push(0, torch.ones(3), version=5)
    with pytest.raises(RuntimeError, match="worker 0 pushed twice for version 5"):
        acc.push(0, torch.ones(3), version=5)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        acc.push(1, torch.ones(2), version=5)


def test_sync_accumulator_excludes_dead_workers_from_the_wait():
    acc = SyncAccumulator(3)
    acc.push(0, torch.tensor([2.0]), version=0)
    acc.push(1, torch.tensor([4.0]), version=0)
    assert not acc.ready()
    acc.mark_dead(2)
    assert acc.ready()
    assert torch.equal(acc.mean(), torch.tensor([3.0]))
    acc.advance()
    with pytest.raises(RuntimeError, match="worker 2 was marked dead"):
        acc.push(2, torch.tensor([1.0]), version=1)
    # a gradient pushed before its worker died still counts
    acc.push(1, torch.tensor([6.0]), version=1)
    acc.mark_dead(1)
    assert not acc.ready()
    acc.push(0, torch.tensor([2.0]), version=1)
    assert acc.ready() and torch.equal(acc.mean(), torch.tensor([4.0]))


def test_sync_accumulator_with_every_worker_dead_is_never_ready():
    acc = SyncAccumulator(2)
    acc.mark_dead(0)
    acc.mark_dead(1)
    assert not acc.ready()
    with pytest.raises(RuntimeError, match="not complete"):
        acc.mean()
