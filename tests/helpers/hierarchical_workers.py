"""Worker for ``torch.multiprocessing.spawn``: the two-level all-reduce against the flat one, 2 simulated hosts x 2.

Ranks 0-1 play host 0 and ranks 2-3 host 1 (node rank ``rank // 2``). Each rank trains two copies of one model with
SGD on the same data: one on DDP's flat all-reduce, one on the two-level hook; rank 0 saves both final models and
every rank's inter-host bytes per step, for each case of :data:`CASES`. :func:`two_level_on_nccl` runs the same cases
on NCCL, one GPU per rank (tests/gpu).
"""

from __future__ import annotations

import faulthandler
import os
import sys
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ds_lightning.comm import GradientCompressor, hierarchical
from ds_lightning.comm.hierarchical import host_groups
from tests.helpers.dist_workers import _init

TIMEOUT = timedelta(seconds=60)
STEPS = 4
WEIGHTS = (0.5, 1.5, 1.25, 0.75)  # per-rank gradient weights (a load balancer's), when weighted


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))


#: (inter-host compression, weighted) pairs, each trained flat and two-level in one process group.
CASES = (("none", False), ("none", True), ("fp16", False), ("bf16", False), ("powersgd", False))


def _case(rank: int, groups: object, compression: str, weighted: bool, device: torch.device | None = None) -> dict:
    device = device or torch.device("cpu")
    ids = [device.index] if device.type == "cuda" else None
    runs = []
    for hosts, name in ((None, "none"), (groups, compression)):
        model = DistributedDataParallel(_model().to(device), device_ids=ids, bucket_cap_mb=0.0001)  # several buckets
        # Full rank and every matrix compressed: PowerSGD's projection is then exact.
        compressor = GradientCompressor(
            name, powersgd_rank=12, powersgd_start_iter=1, powersgd_min_compression_rate=1e-3
        )
        compressor.register(model, weighted=weighted, hosts=hosts)  # type: ignore[arg-type]
        compressor.weight = WEIGHTS[rank] if weighted else 1.0
        runs.append((model, compressor, torch.optim.SGD(model.parameters(), lr=0.2)))
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5, 12, generator=g).to(device), torch.randint(0, 3, (5,), generator=g).to(device)
        for model, _, optimizer in runs:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    sent = [0.0] * dist.get_world_size()
    dist.all_gather_object(sent, runs[1][1].bytes_per_step)
    return {
        "flat": [p.detach().cpu().clone() for p in runs[0][0].parameters()],
        "two_level": [p.detach().cpu().clone() for p in runs[1][0].parameters()],
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


#: The layouts 2 processes can take: one host of 2 (the in-host reduce and broadcast around a leaders' stage of one)
#: and 2 hosts of 1 (the leaders' all-reduce alone).
NCCL_LAYOUTS = ("one_host", "two_hosts")


def two_level_on_nccl(rank: int, world: int, port: int, out: str) -> None:
    """Every case of :data:`CASES` on NCCL (one GPU per rank) in each layout of :data:`NCCL_LAYOUTS`; rank 0 saves the
    results by ``layout/case`` and each layout's hosts.

    On 2 processes the two-level path saves nothing, so ``host_groups`` alone would return ``None`` (the flat ring):
    the decision is forced here, the groups and the hook are the strategy's own.
    """
    device = _init(rank, world, port, backend="nccl")
    try:
        results, hosts = {}, {}
        with mock.patch.object(hierarchical, "use_hierarchy", return_value=True):
            for layout in NCCL_LAYOUTS:
                groups = host_groups(True, 0 if layout == "one_host" else rank, device, TIMEOUT)
                assert groups is not None
                hosts[layout] = groups.layout.hosts
                for name, weighted in CASES:
                    results[f"{layout}/{name}-{weighted}"] = _case(rank, groups, name, weighted, device)
        if rank == 0:
            torch.save({"cases": results, "hosts": hosts}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
