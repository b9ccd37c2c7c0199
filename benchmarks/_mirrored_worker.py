"""One benchmark run on 2 CPU processes: a Lightning strategy, or a plain torch DDP loop (the floor).

Started by ``benchmarks/mirrored.py``; writes one JSON with per-step times measured on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ds_lightning
from ds_lightning.demos import TrainingReport, load_digits_tensors, make_mlp


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


def run_lightning(args: argparse.Namespace) -> None:
    pl.seed_everything(0)
    strategy = args.strategy
    if strategy == "ds_mirrored" and args.compression != "none":
        strategy = ds_lightning.MirroredStrategy(gradient_compression=args.compression, powersgd_start_iter=2)
    report = TrainingReport(warmup_steps=args.warmup, output_json=args.out)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[report],
    )
    loader = DataLoader(_dataset(), batch_size=args.batch_size, shuffle=True, drop_last=True)
    trainer.fit(BenchModel(args.hidden), train_dataloaders=loader)
    if trainer.is_global_zero:
        data = json.loads(Path(args.out).read_text())
        data["step_ms"] = [1000 * t for t in report.step_times]
        Path(args.out).write_text(json.dumps(data))


def _plain_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_mlp(64, args.hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dataset = _dataset()
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    times: list[float] = []
    step, epoch = 0, 0
    while step < args.warmup + args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            elapsed = time.perf_counter() - start
            step += 1
            if step > args.warmup:
                times.append(elapsed)
            if step == args.warmup + args.steps:
                break
        epoch += 1
    dist.barrier()
    if rank == 0:
        out = {
            "strategy": "plain_ddp",
            "median_step_ms": 1000 * statistics.median(times),
            "step_ms": [1000 * t for t in times],
        }
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def run_plain(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    mp.spawn(_plain_worker, args=(args, find_free_network_port()), nprocs=2, join=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["lightning", "plain"], required=True)
    parser.add_argument("--strategy", default="ds_mirrored")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.mode == "plain":
        run_plain(args)
    else:
        run_lightning(args)


if __name__ == "__main__":
    main()
