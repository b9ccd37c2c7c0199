"""The GPipe clock: exact schedules, every task exactly once, dependencies respected."""

from __future__ import annotations

import pytest

from ds_lightning.pipeline.clock import clock_cycles


def test_three_microbatches_two_stages_exactly():
    assert clock_cycles(3, 2) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1)],
        [(2, 1)],
    ]


@pytest.mark.parametrize(
    ("m", "n", "expected"),
    [
        (1, 1, [[(0, 0)]]),
        (1, 3, [[(0, 0)], [(0, 1)], [(0, 2)]]),
        (3, 1, [[(0, 0)], [(1, 0)], [(2, 0)]]),
        (3, 3, [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1), (0, 2)], [(2, 1), (1, 2)], [(2, 2)]]),
        (2, 4, [[(0, 0)], [(1, 0), (0, 1)], [(1, 1), (0, 2)], [(1, 2), (0, 3)], [(1, 3)]]),
    ],
)
def test_small_schedules_exactly(m, n, expected):
    assert clock_cycles(m, n) == expected


@pytest.mark.parametrize(("m", "n"), [(1, 1), (3, 2), (2, 5), (8, 4), (4, 8)])
def test_every_task_once_in_m_plus_n_minus_1_ticks_after_its_input(m, n):
    schedule = clock_cycles(m, n)
    assert len(schedule) == m + n - 1
    cells = [task for tick in schedule for task in tick]
    assert sorted(cells) == [(i, j) for i in range(m) for j in range(n)]
    tick_of = {task: k for k, tick in enumerate(schedule) for task in tick}
    for (i, j), k in tick_of.items():
        assert i + j == k
        if j > 0:
            assert tick_of[(i, j - 1)] == k - 1  # stage j - 1 produced the input one tick earlier
    for tick in schedule:
        stages = [j for _, j in tick]
        assert stages == sorted(set(stages))  # one task per stage, by stage ascending


@pytest.mark.parametrize(
    ("m", "n", "message"),
    [(0, 2, "n_microbatches=0"), (2, 0, "n_stages=0"), (True, 2, "n_microbatches=True"), (2, 1.5, "n_stages=1.5")],
)
def test_bad_counts_name_the_value(m, n, message):
    with pytest.raises(ValueError, match=message):
        clock_cycles(m, n)
