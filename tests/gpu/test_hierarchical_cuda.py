"""The two-level (hierarchical) all-reduce hook on NCCL, one GPU per rank, against DDP's flat NCCL all-reduce.

Two processes are laid out as one host of 2 (the in-host reduce and broadcast around a leaders' stage of one) and as
2 hosts of 1 (the leaders' all-reduce alone, compressed), with the CPU tests' worker (tests/comm/test_hierarchical.py)
on NCCL. Two levels over 2 hosts x 2 processes need 4 GPUs; these two layouts cover every collective of the hook.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.gpu._cuda import needs_gpus
from tests.helpers import hierarchical_workers
from tests.helpers.runner import free_port

pytestmark = pytest.mark.cuda

#: Leaders, by layout: rank 0 leads the one host; each rank leads its own.
LEADERS = {"one_host": (True, False), "two_hosts": (True, True)}


def _max_difference(result: dict) -> float:
    return max((a - b).abs().max().item() for a, b in zip(result["flat"], result["two_level"], strict=True))


@pytest.mark.multiprocess
def test_two_level_hook_on_nccl_matches_the_flat_ring(tmp_path):
    needs_gpus(2)
    out = tmp_path / "result.pt"
    mp.spawn(hierarchical_workers.two_level_on_nccl, args=(2, free_port(), str(out)), nprocs=2, join=True)
    runs = torch.load(out, weights_only=True)
    assert runs["hosts"] == {"one_host": ((0, 1),), "two_hosts": ((0,), (1,))}
    for layout, leaders in LEADERS.items():
        cases = {name: runs["cases"][f"{layout}/{name}"] for name in ("none-False", "none-True", "fp16-False")}
        for name, result in cases.items():
            # Only the leaders send in the inter-host stage: one full-width (or half-width) gradient each per step.
            full = result["uncompressed"] / (2 if name.startswith("fp16") else 1)
            assert result["bytes"] == [full if lead else 0.0 for lead in leaders], (layout, name, result["bytes"])
        assert _max_difference(cases["none-False"]) <= 1e-5, layout
        # The load balancer's weights apply before the in-host reduce: the weighted run differs from the plain one and
        # still follows the weighted flat ring.
        plain, weighted = cases["none-False"], cases["none-True"]
        assert max((a - b).abs().max().item() for a, b in zip(plain["flat"], weighted["flat"], strict=True)) > 1e-3
        assert _max_difference(weighted) <= 1e-5, layout
        for half in ("fp16", "bf16"):  # rounded in the leaders' stage only
            assert _max_difference(runs["cases"][f"{layout}/{half}-False"]) < 1e-2, (layout, half)
        powersgd = runs["cases"][f"{layout}/powersgd-False"]  # full rank: the projection is exact
        assert _max_difference(powersgd) < 1e-4, layout
        assert powersgd["bytes"][0] > 0 and (leaders[1] or powersgd["bytes"][1] == 0.0), powersgd["bytes"]
