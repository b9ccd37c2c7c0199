"""One mirrored-benchmark run on 2 CPU processes: a Lightning strategy, or a plain torch DDP loop (the floor).

Started by ``benchmarks/mirrored.py`` with a JSON spec; rank 0 writes ``result.json`` with its per-step times (the
harness's ``StepTimer`` for Lightning; the same span, timed by hand, for the plain loop) and the bytes sent per step.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ds_lightning
from benchmarks.harness.timing import StepTimer
from ds_lightning.demos import load_digits_tensors, make_mlp
from ds_lightning.testing import free_port


def _dataset() -> TensorDataset:
    x, y = load_digits_tensors()
    return TensorDataset(x, y)


class BenchModel(pl.LightningModule):
    """The bare minimum around the MLP, so the comparison with a plain loop measures the framework only."""

    def __init__(self, hidden: list[int]) -> None:
        super().__init__()
        self.net = make_mlp(64, hidden, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def run_lightning(spec: dict[str, Any]) -> None:
    pl.seed_everything(0, verbose=False)
    strategy: Any = spec["strategy"]
    if strategy == "ds_mirrored" and spec["compression"] != "none":
        strategy = ds_lightning.MirroredStrategy(gradient_compression=spec["compression"], powersgd_start_iter=2)
    timer = StepTimer(warmup=spec["warmup"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=spec["warmup"] + spec["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
    )
    loader = DataLoader(_dataset(), batch_size=spec["batch_size"], shuffle=True, drop_last=True)
    trainer.fit(BenchModel(spec["hidden"]), train_dataloaders=loader)
    if trainer.is_global_zero:
        out = timer.reading()
        for attr in ("comm_bytes_per_step", "uncompressed_bytes_per_step"):
            if hasattr(trainer.strategy, attr):
                out[attr] = float(getattr(trainer.strategy, attr))
        Path(spec["out_dir"], "result.json").write_text(json.dumps(out))


def _plain_worker(rank: int, spec: dict[str, Any], port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_mlp(64, spec["hidden"], 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dataset = _dataset()
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=spec["batch_size"], sampler=sampler, drop_last=True)
    total = spec["warmup"] + spec["steps"]
    times: list[float] = []
    epoch = 0
    while len(times) < total:
        sampler.set_epoch(epoch)
        for x, y in loader:
            start = time.perf_counter()  # the span StepTimer takes in Lightning: forward, backward, step
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            times.append(1000 * (time.perf_counter() - start))
            if len(times) == total:
                break
        epoch += 1
    dist.barrier()
    if rank == 0:
        timed = times[spec["warmup"] :]
        out = {"step_ms": times, "warmup": spec["warmup"], "median_step_ms": statistics.median(timed)}
        Path(spec["out_dir"], "result.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["mode"] == "plain":
        mp.spawn(_plain_worker, args=(spec, free_port()), nprocs=2, join=True)
    else:
        run_lightning(spec)


if __name__ == "__main__":
    main(sys.argv[1])
