"""One memory-benchmark run: ``ds_mirrored``, plain or sharded (``engine`` zero or fsdp2), on N CPU processes; rank
0 gathers every rank's figures into ``result.json`` (see ``README.md``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ds_lightning
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.timing import StepTimer
from benchmarks.harness.trainer import quiet_trainer
from benchmarks.mirrored.worker import BenchModel
from benchmarks.sharding_engines.common import (
    broadcast_bytes,
    broadcasts_per_step,
    fsdp_bytes,
    make_optimizer,
    rank_figures,
)


class AdamModel(BenchModel):
    @override
    def configure_optimizers(self):
        return make_optimizer(self.model_name, self.parameters())


class MemoryReading(Callback):
    """Every rank's figures at the end of training, gathered on rank 0 (every rank joins the gather)."""

    ranks: list[dict[str, Any]] = []

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        while hasattr(optimizer, "_optimizer"):  # Lightning's LightningOptimizer
            optimizer = optimizer._optimizer
        rank, world = trainer.global_rank, trainer.world_size
        sent, calls = 0, 0
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            partition, bucket_view = optimizer._partition_parameters(), bool(optimizer.parameters_as_bucket_view)
            sent, calls = broadcast_bytes(partition, bucket_view)[rank], broadcasts_per_step(partition, bucket_view)
        fsdp2 = isinstance(trainer.strategy.model, FSDPModule)
        gather, scatter = fsdp_bytes(list(pl_module.parameters()), world) if fsdp2 else (0, 0)
        counted = {
            "allreduce_bytes": 0.0 if fsdp2 else float(trainer.strategy.comm_bytes_per_step),
            "broadcast_bytes": sent,
            "broadcast_calls": calls,
            "allgather_bytes": gather,
            "reducescatter_bytes": scatter,
        }
        self.ranks = [None] * world
        dist.all_gather_object(self.ranks, rank_figures(rank, optimizer, counted))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    workload = _workloads.build(spec["workload"], spec["hidden"])
    timer, reading = StepTimer(warmup=spec["warmup"]), MemoryReading()
    strategy = ds_lightning.MirroredStrategy(shard_optimizer_state=spec["sharded"], sharding_engine=spec["engine"])
    steps = spec["warmup"] + spec["steps"]
    trainer = quiet_trainer(
        accelerator="cpu", devices=spec["procs"], strategy=strategy, max_steps=steps, callbacks=[timer, reading]
    )
    loader = DataLoader(workload.train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=True)
    trainer.fit(AdamModel(workload), train_dataloaders=loader)
    if trainer.is_global_zero:
        out = {**timer.reading(), "ranks": reading.ranks, "parameters": workload.parameters}
        Path(spec["out_dir"], "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
