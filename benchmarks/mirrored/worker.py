"""One mirrored-benchmark run on 2 CPU processes: a Lightning strategy, or a plain torch DDP loop (the floor); rank
0 writes ``result.json`` (what it holds: ``README.md``)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ds_lightning
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.timing import StepTimer
from benchmarks.harness.trainer import quiet_trainer
from benchmarks.mirrored.auto import auto_reading
from benchmarks.sharding_engines.common import timed_steps
from ds_lightning.testing import free_port


def make_optimizer(model: str, params: Any) -> torch.optim.Optimizer:
    if model == "gpt":
        return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


class BenchModel(pl.LightningModule):
    """The bare minimum around the workload's net, so the comparison with a plain loop measures the framework only."""

    def __init__(self, workload: _workloads.Workload) -> None:
        super().__init__()
        self.net, self.loss, self.model_name = workload.net, workload.loss, workload.name

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss(self.net(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.model_name, self.parameters())


def run_lightning(spec: dict[str, Any]) -> None:
    pl.seed_everything(0, verbose=False)
    workload = _workloads.build(spec["workload"])
    strategy: Any = spec["strategy"]
    if strategy == "ds_mirrored" and spec["compression"] == "auto":  # the strategy's defaults, as a user gets them
        interval = {} if spec.get("auto_interval") is None else {"auto_interval": spec["auto_interval"]}
        strategy = ds_lightning.MirroredStrategy(gradient_compression="auto", **interval)
    elif strategy == "ds_mirrored" and spec["compression"] != "none":
        strategy = ds_lightning.MirroredStrategy(gradient_compression=spec["compression"], powersgd_start_iter=2)
    elif strategy == "ddp":  # like for like with ds_mirrored, whose default is gradient_as_bucket_view=True
        strategy = DDPStrategy(gradient_as_bucket_view=spec["bucket_view"])
    timer = StepTimer(warmup=spec["warmup"])
    steps = spec["warmup"] + spec["steps"]
    trainer = quiet_trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, callbacks=[timer])
    loader = DataLoader(workload.train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=True)
    trainer.fit(BenchModel(workload), train_dataloaders=loader)
    if trainer.is_global_zero:
        out = timer.reading()
        out["mean_step_ms"] = statistics.fmean(timer.timed_ms)  # counts the steps that probed the link (auto)
        auto = auto_reading(trainer.strategy)
        if auto is not None:
            out["auto"] = auto
        for attr in ("comm_bytes_per_step", "uncompressed_bytes_per_step"):
            if hasattr(trainer.strategy, attr):
                out[attr] = float(getattr(trainer.strategy, attr))
        Path(spec["out_dir"], "result.json").write_text(json.dumps(out))


def _plain_worker(rank: int, spec: dict[str, Any], port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    workload = _workloads.build(spec["workload"])
    model = nn.parallel.DistributedDataParallel(workload.net, gradient_as_bucket_view=spec["bucket_view"])
    optimizer = make_optimizer(workload.name, model.parameters())
    times = timed_steps(workload, model, optimizer, 2, rank, spec["batch_size"], spec["warmup"] + spec["steps"])
    dist.barrier()
    if rank == 0:
        timed = times[spec["warmup"] :]
        out = {"step_ms": times, "warmup": spec["warmup"], "median_step_ms": statistics.median(timed)}
        out["mean_step_ms"] = statistics.fmean(timed)
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
