"""Worker for ``torch.multiprocessing.spawn``: each compression on a plain torch DDP model, logging what it sent."""

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

STEPS = 3
POWERSGD_RANK = 2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def expected_powersgd_bytes(module: nn.Module, rank: int, min_compression_rate: float = 2.0) -> int:
    """Bytes per compressed step, from shapes: ``(n + m) * r`` per matrix worth compressing, other tensors whole."""
    total = 0
    for param in module.parameters():
        if param.dim() < 2:
            total += param.numel() * param.element_size()
            continue
        n, m = param.shape[0], param.numel() // param.shape[0]
        r = min(n, m, rank)
        worth = (n + m) * r * min_compression_rate < n * m
        total += ((n + m) * r if worth else n * m) * param.element_size()
    return total


def _run(compressor: GradientCompressor, rank: int, world: int, weighted: bool) -> dict:
    # Small buckets: several per step, as a real model has; bucket views as ds_mirrored uses them.
    ddp = DistributedDataParallel(model(), bucket_cap_mb=0.01, gradient_as_bucket_view=True)
    compressor.register(ddp, weighted=weighted)
    reference = model()
    grads, expected = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        reference.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        expected = []
        for p in reference.parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad)
            expected.append(grad / world)
        grads = [p.grad.clone() for p in ddp.module.parameters()]
    wire = compressor.wire
    return {
        "bytes_per_step": compressor.bytes_per_step,
        "uncompressed_bytes_per_step": compressor.uncompressed_bytes_per_step,
        "rounds": compressor.rounds,
        "steps": wire.steps if wire else None,
        "last_step_bytes": wire.last_step_bytes if wire else None,
        "dtypes": sorted(wire.dtypes) if wire else None,
        "grads": grads,  # of the last step
        "expected": expected,
    }


def log_every_compression(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 saves, per setting, the measured bytes and dtypes and the last step's gradients against the mean."""
    faulthandler.dump_traceback_later(120, exit=True, file=sys.stderr)  # a hang fails fast with stacks
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        results = {
            "none": _run(GradientCompressor("none"), rank, world, weighted=False),
            # weighted=True registers the logged plain all-reduce hook: what DDP's own all-reduce sends, measured.
            "none_logged": _run(GradientCompressor("none"), rank, world, weighted=True),
            "fp16": _run(GradientCompressor("fp16"), rank, world, weighted=False),
            "bf16": _run(GradientCompressor("bf16"), rank, world, weighted=False),
            "powersgd": _run(
                GradientCompressor("powersgd", powersgd_rank=POWERSGD_RANK, powersgd_start_iter=1),
                rank,
                world,
                weighted=False,
            ),
        }
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
