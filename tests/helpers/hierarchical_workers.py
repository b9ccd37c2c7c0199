"""Worker for ``torch.multiprocessing.spawn``: the two-level all-reduce against the flat one, 2 simulated hosts x 2.

Ranks 0-1 play host 0 and ranks 2-3 host 1 (node rank ``rank // 2``). Each rank trains two copies of one model with
SGD on the same data: one on DDP's flat all-reduce, one on the two-level hook; rank 0 saves both final models and
every rank's inter-host bytes per step, for each case of :data:`CASES`.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ds_lightning.comm import GradientCompressor
from ds_lightning.comm.hierarchical import host_groups

TIMEOUT = timedelta(seconds=60)
STEPS = 4
WEIGHTS = (0.5, 1.5, 1.25, 0.75)  # per-rank gradient weights (a load balancer's), when weighted


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))


#: (inter-host compression, weighted) pairs, each trained flat and two-level in one process group.
CASES = (("none", False), ("none", True), ("fp16", False), ("bf16", False), ("powersgd", False))


def _case(rank: int, groups: object, compression: str, weighted: bool) -> dict:
    runs = []
    for hosts, name in ((None, "none"), (groups, compression)):
        model = DistributedDataParallel(_model(), bucket_cap_mb=0.0001)  # several buckets
        # Full rank and every matrix compressed: PowerSGD's projection is then exact.
        compressor = GradientCompressor(
            name, powersgd_rank=12, powersgd_start_iter=1, powersgd_min_compression_rate=1e-3
        )
        compressor.register(model, weighted=weighted, hosts=hosts)  # type: ignore[arg-type]
        compressor.weight = WEIGHTS[rank] if weighted else 1.0
        runs.append((model, compressor, torch.optim.SGD(model.parameters(), lr=0.2)))
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5, 12, generator=g), torch.randint(0, 3, (5,), generator=g)
        for model, _, optimizer in runs:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    sent = [0.0] * dist.get_world_size()
    dist.all_gather_object(sent, runs[1][1].bytes_per_step)
    return {
        "flat": [p.detach().clone() for p in runs[0][0].parameters()],
        "two_level": [p.detach().clone() for p in runs[1][0].parameters()],
        "bytes": sent,
        "uncompressed": runs[1][1].uncompressed_bytes_per_step,
    }


def two_level_against_flat(rank: int, world: int, port: int, out: str) -> None:
    """Train flat and two-level copies side by side for every case; rank 0 saves the results by case name."""
    faulthandler.dump_traceback_later(120, exit=True, file=sys.stderr)  # a hang fails fast, with stacks
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        groups = host_groups(True, rank // 2, torch.device("cpu"), TIMEOUT)
        assert groups is not None
        results = {f"{name}-{weighted}": _case(rank, groups, name, weighted) for name, weighted in CASES}
        # Uneven hosts: 3 processes and 1 (the lone one has no in-host stage).
        uneven = host_groups(True, int(rank == 3), torch.device("cpu"), TIMEOUT)
        assert uneven is not None
        results["uneven"] = _case(rank, uneven, "none", False)
        if rank == 0:
            torch.save({"cases": results, "leaders": groups.layout.leaders, "uneven": uneven.layout.hosts}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
