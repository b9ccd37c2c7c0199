"""Splitting an nn.Sequential into stages: equal, explicit and cost-balanced partitions."""

from __future__ import annotations

import itertools

import pytest

from ds_lightning.pipeline import partition_by_cost, resolve_balance, stage_layer_ranges


def test_equal_balance_gives_the_remainder_to_the_first_stages():
    assert resolve_balance(9, 2, None) == [5, 4]
    assert resolve_balance(10, 4, None) == [3, 3, 2, 2]
    assert resolve_balance(3, 3, None) == [1, 1, 1]


def test_explicit_balance_is_kept():
    assert resolve_balance(5, 2, [1, 4]) == [1, 4]
    assert stage_layer_ranges([1, 4, 2]) == [range(0, 1), range(1, 5), range(5, 7)]


@pytest.mark.parametrize(
    ("layers", "stages", "balance", "message"),
    [
        (3, 4, None, "4 pipeline stages but the pipelined nn.Sequential has only 3 layers"),
        (
            5,
            2,
            [2, 2],
            r"balance=\[2, 2\] sums to 4 but the pipelined nn.Sequential has 5 layers.*e.g. balance=\[3, 2\]",
        ),
        (5, 2, [5], r"balance=\[5\] has 1 entries but the pipeline has 2 stages"),
        (5, 2, [5, 0], "must hold positive integers"),
    ],
)
def test_bad_balances_name_the_numbers_and_a_valid_one(layers, stages, balance, message):
    with pytest.raises(ValueError, match=message):
        resolve_balance(layers, stages, balance)


def _brute_force(costs, stages):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        if best is None or worst < best:
            best = worst
    return best


@pytest.mark.parametrize(
    ("costs", "stages"),
    [
        ([1, 1, 1, 1], 2),
        ([1, 1, 10, 1, 1], 3),
        ([5, 1, 1, 1, 1, 1], 2),
        ([3, 1, 4, 1, 5, 9, 2, 6], 3),
        ([0.2, 0.1, 0.7, 0.3, 0.3, 0.9, 0.05], 4),
    ],
)
def test_partition_by_cost_minimises_the_slowest_stage(costs, stages):
    balance = partition_by_cost(costs, stages)
    assert len(balance) == stages and sum(balance) == len(costs) and min(balance) >= 1
    worst = max(sum(costs[r.start : r.stop]) for r in stage_layer_ranges(balance))
    assert worst == pytest.approx(_brute_force(costs, stages))


def test_a_heavy_layer_ends_up_alone():
    balance = partition_by_cost([1, 1, 1, 50, 1, 1], 4)
    starts = [sum(balance[:i]) for i in range(4)]
    assert balance[starts.index(3)] == 1


def test_partition_is_deterministic_on_ties():
    assert partition_by_cost([1.0] * 6, 3) == partition_by_cost([1.0] * 6, 3) == [2, 2, 2]
