"""The two-level all-reduce: host grouping and the auto rule (pure), then real gloo processes against the flat ring."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from jsonargparse import ArgumentParser

from ds_lightning import MirroredStrategy
from ds_lightning.comm.hierarchical import HostLayout, use_hierarchy
from ds_lightning.testing.processes import free_port
from tests.helpers import hierarchical_workers


def test_hosts_group_ranks_by_node_rank_leaders_first():
    layout = HostLayout.from_node_ranks([0, 0, 1, 1])
    assert layout.hosts == ((0, 1), (2, 3))
    assert layout.leaders == (0, 2) and layout.local_world_sizes == (2, 2) and layout.world_size == 4
    assert [layout.host_of(r) for r in range(4)] == [0, 0, 1, 1]


def test_hosts_may_be_uneven_and_listed_out_of_order():
    # torchrun or TF_CONFIG may number ranks so that a host's ranks are not contiguous.
    layout = HostLayout.from_node_ranks([1, 0, 1, 1, 0])
    assert layout.hosts == ((1, 4), (0, 2, 3))
    assert layout.leaders == (1, 0) and layout.local_world_sizes == (2, 3)
    with pytest.raises(ValueError, match="rank 7 is on no host"):
        layout.host_of(7)


@pytest.mark.parametrize(
    ("node_ranks", "setting", "expected"),
    [
        ([0, 0, 1, 1], "auto", True),  # 2 hosts x 2
        ([0, 1, 1], "auto", True),  # uneven: one host with 2 processes is enough
        ([0, 0, 0, 0], "auto", False),  # one host: nothing crosses hosts
        ([0, 1, 2], "auto", False),  # one process per host: the leaders' ring is the flat ring
        ([0, 0, 1, 1], False, False),
        ([0, 0, 1, 1], True, True),
        ([0, 0], True, False),  # one host: flat, with an info log
    ],
)
def test_auto_rule(node_ranks, setting, expected):
    assert use_hierarchy(setting, HostLayout.from_node_ranks(node_ranks)) is expected


def test_true_on_one_host_logs_that_it_runs_flat(caplog):
    with caplog.at_level("INFO", logger="ds_lightning.comm.hierarchical"):
        assert use_hierarchy(True, HostLayout.from_node_ranks([0, 0])) is False
    assert "hierarchical=True but the run has 1 host(s)" in caplog.text


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_hierarchical_names_the_value(value):
    with pytest.raises(ValueError, match=rf"hierarchical={value!r} is not a choice: use True, False or 'auto'"):
        MirroredStrategy(hierarchical=value)


@pytest.mark.parametrize(("text", "expected"), [("true", True), ("false", False), ("auto", "auto")])
def test_hierarchical_from_yaml_keeps_bool_and_auto_apart(text, expected):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=MirroredStrategy)
    config = parser.parse_string(
        f"strategy:\n  class_path: ds_lightning.strategies.MirroredStrategy\n  init_args:\n    hierarchical: {text}\n"
    )
    hierarchical = parser.instantiate_classes(config).strategy.hierarchical
    assert hierarchical == expected and type(hierarchical) is type(expected)


def test_hierarchical_true_with_own_comm_hook_is_refused():
    with pytest.raises(ValueError, match="remove ddp_comm_hook, or set hierarchical='auto' or False"):
        MirroredStrategy(ddp_comm_hook=lambda state, bucket: None, hierarchical=True)
    MirroredStrategy(ddp_comm_hook=lambda state, bucket: None)  # "auto" leaves the user's hook alone


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every case of the worker in one 4-process spawn (2 simulated hosts x 2): process start-up dominates."""
    out = tmp_path_factory.mktemp("hierarchical") / "result.pt"
    mp.spawn(hierarchical_workers.two_level_against_flat, args=(4, free_port(), str(out)), nprocs=4, join=True)
    return torch.load(out, weights_only=True)


def _max_difference(result: dict) -> float:
    return max((a - b).abs().max().item() for a, b in zip(result["flat"], result["two_level"], strict=True))


@pytest.mark.multiprocess
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "load-balancer-weighted"])
def test_two_level_equals_flat_ring_and_only_leaders_cross_hosts(runs, weighted):
    assert runs["leaders"] == (0, 2)
    result = runs["cases"][f"none-{weighted}"]
    assert _max_difference(result) <= 1e-5
    # Only the leaders send across hosts, one full-width gradient each per step.
    assert result["bytes"] == [result["uncompressed"], 0.0, result["uncompressed"], 0.0]


@pytest.mark.multiprocess
def test_weighting_applies_before_the_intra_host_reduce(runs):
    # Weighted and plain runs differ (the weights are not all 1), and the two-level run followed the weighted flat one.
    plain, weighted = runs["cases"]["none-False"], runs["cases"]["none-True"]
    assert max((a - b).abs().max().item() for a, b in zip(plain["flat"], weighted["flat"], strict=True)) > 1e-3
    assert _max_difference(weighted) <= 1e-5


@pytest.mark.multiprocess
def test_uneven_hosts_match_the_flat_ring(runs):
    assert runs["uneven"] == ((0, 1, 2), (3,))
    result = runs["cases"]["uneven"]
    assert _max_difference(result) <= 1e-5
    assert result["bytes"] == [result["uncompressed"], 0.0, 0.0, result["uncompressed"]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("half", ["fp16", "bf16"])
def test_half_width_applies_to_the_inter_host_stage_only(runs, half):
    result = runs["cases"][f"{half}-False"]
    assert _max_difference(result) < 1e-2
    assert result["bytes"] == [result["uncompressed"] / 2, 0.0, result["uncompressed"] / 2, 0.0]


@pytest.mark.multiprocess
def test_full_rank_powersgd_among_leaders_equals_flat_ring(runs):
    # At full rank PowerSGD's projection is exact, so the two-level run must follow the flat one.
    result = runs["cases"]["powersgd-False"]
    assert _max_difference(result) < 1e-4
    assert result["bytes"][1] == result["bytes"][3] == 0.0 and result["bytes"][0] > 0
