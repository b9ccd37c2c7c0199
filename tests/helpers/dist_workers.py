"""Worker functions for ``torch.multiprocessing.spawn`` in tests: plain torch DDP on gloo, one thread each."""

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


def _init(rank: int, world: int, port: int, backend: str = "gloo") -> torch.device:
    """Join the process group on ``backend``; return this rank's device (``cuda:<rank>`` under NCCL, else the CPU)."""
    # A hung worker prints its stacks and exits, so the test fails fast instead of waiting for pytest's timeout.
    faulthandler.dump_traceback_later(120, exit=True, file=sys.stderr)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives, all_gather_object's too, run on the current device
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    return device


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))


def full_rank_powersgd_equals_mean(rank: int, world: int, port: int, out: str) -> None:
    """With rank >= min(n, m), PowerSGD's projection is exact: gradients must equal the plain all-reduce mean."""
    _init(rank, world, port)
    try:
        model = DistributedDataParallel(_model(), bucket_cap_mb=0.0001)  # several buckets
        compressor = GradientCompressor(
            "powersgd", powersgd_rank=12, powersgd_start_iter=1, powersgd_min_compression_rate=1e-3
        )
        compressor.register(model)
        reference = _model()
        results = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(5, 12, generator=g), torch.randint(0, 3, (5,), generator=g)
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            reference.zero_grad()
            nn.functional.cross_entropy(reference(x), y).backward()
            expected = []
            for p in reference.parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad)
                expected.append(grad / world)
            results.append(([p.grad.clone() for p in model.module.parameters()], expected))
        if rank == 0:
            torch.save({"results": results, "bytes": compressor.bytes_per_step}, out)
        dist.barrier()
        del model
    finally:
        dist.destroy_process_group()
