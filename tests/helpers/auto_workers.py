"""Worker functions for ``torch.multiprocessing.spawn``: the auto-compression probe and forced switches on gloo (or on
NCCL, one GPU per rank: tests/gpu)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ds_lightning.comm import GradientCompressor
from ds_lightning.comm.auto import AllReduceFit, LinkFigures, compression_compute, probe_link
from ds_lightning.comm.compression import CompressionOptions, auto_candidates
from tests.helpers.dist_workers import _init

SLOW = LinkFigures(2, AllReduceFit(1e-4, 1e6), AllReduceFit(1e-4, 1e6), {"fp16": 0.0, "powersgd": 0.0})
FAST = LinkFigures(2, AllReduceFit(1e-6, 1e11), AllReduceFit(1e-6, 1e11), {"fp16": 1e-3, "powersgd": 1e-2})


def probe_then_switch(rank: int, world: int, port: int, out: str, backend: str = "gloo") -> None:
    """One process group for both checks (starting processes dominates their time): :func:`_probe_figures`, then
    :func:`_forced_switches`; each rank writes ``{out}.probe.rank{R}.pt`` and ``{out}.switch.rank{R}.pt``."""
    device = _init(rank, world, port, backend)
    try:
        torch.save(_probe_figures(device), f"{out}.probe.rank{rank}.pt")
        torch.save(_forced_switches(rank, device), f"{out}.switch.rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _probe_figures(device: torch.device) -> dict:
    """This rank's compression compute, and two probes of the link (loopback, or NCCL's between GPUs)."""
    options = CompressionOptions(powersgd_rank=2)
    probes = {m.name: m(options).compute_probe([(100, 100)], device) for m in auto_candidates()}  # one 100 x 100
    compute = compression_compute({name: probe for name, probe in probes.items() if probe is not None}, device)
    figures = [probe_link(None, device, compute).as_dict() for _ in range(2)]
    return {"figures": figures, "local_compute": compute}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4))


def _forced_switches(rank: int, device: torch.device) -> dict:
    """Train 24 steps under auto (interval 4, several buckets) while rank 0's figures flip slow, fast, slow.

    Rank 1 is given the opposite figures throughout: the ranks agree only if rank 0's choice is broadcast.
    """
    ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(_model().to(device), device_ids=ids, bucket_cap_mb=0.005)
    compressor = GradientCompressor("auto", powersgd_rank=2, powersgd_start_iter=6, auto_interval=4)
    compressor.register(model)
    auto = compressor.auto
    assert auto is not None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, choices = [], []
    for step in range(24):
        ours, theirs = (SLOW, FAST) if (step // 8) % 2 == 0 else (FAST, SLOW)
        auto.override = ours if rank == 0 else theirs
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 32, generator=g)
        x, y = x.to(device), (x[:, :4].argmax(dim=1)).long().to(device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        choices.append(auto.choice)
    decisions = [(d.step, d.choice, d.previous, d.probed) for d in auto.decisions]
    return {
        "choices": choices,
        "decisions": decisions,
        "losses": losses,
        "params": [p.detach().cpu().clone() for p in model.module.parameters()],
        "buckets": auto.workload.buckets,
        "state": compressor.state_dict(),
        "dtypes": sorted(compressor.wire.dtypes) if compressor.wire is not None else [],
    }
