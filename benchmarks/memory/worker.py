"""One memory-benchmark run: ds_mirrored, plain or with ``shard_optimizer_state=True``, on N CPU processes.

Started by ``driver.py`` with a JSON spec (``procs``, ``sharded``, ``engine``: ``"zero"`` or ``"fsdp2"``,
the ``"workload"``: the digits MLP under Adam, or the GPT under AdamW; ``harness/workloads.py``). Lightning's
launcher runs this script once per rank. At the end of training every rank reads its own figures (optimizer-state
bytes, peak RSS, the bytes it hands to the gradient all-reduce and, under ``zero``, to ``ZeroRedundancyOptimizer``'s
parameter broadcasts, or under ``fsdp2`` to FSDP2's all-gathers and reduce-scatters); rank 0 gathers them (a
collective every rank joins) and writes ``result.json`` with its step times.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from collections.abc import Mapping, Sequence
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
from ds_lightning.sharding import optimizer_state_bytes

#: ``ZeroRedundancyOptimizer`` with ``parameters_as_bucket_view=True`` broadcasts a one-element fp32 tensor for a rank
#: that owns no trainable parameter (its "dummy bucket")
DUMMY_BUCKET_BYTES = 4


def broadcast_bytes(partition: Sequence[Sequence[Mapping[str, Any]]], bucket_view: bool = False) -> list[int]:
    """Bytes each rank hands, as the source, to ``ZeroRedundancyOptimizer``'s parameter broadcasts in one step.

    After its local step, torch's ``ZeroRedundancyOptimizer`` (``_sync_params``) broadcasts, from every rank, the
    parameters that rank owns: one ``broadcast`` per parameter (its whole ``param.data``, trainable or not), or with
    ``parameters_as_bucket_view=True`` one per rank and device: a flat bucket of the owner's trainable parameters
    (one fp32 element when it owns none). This counts those payloads on one device; it is not a measurement.

    Args:
        partition: per rank, its parameter groups (dicts with ``"params"``), as ``_partition_parameters()`` gives.
        bucket_view: the optimizer's ``parameters_as_bucket_view``.

    Returns:
        Per rank, the bytes it broadcasts as the source per optimizer step.

    """
    out = []
    for groups in partition:
        params = [p for group in groups for p in group["params"]]
        if bucket_view:
            size = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
            out.append(size or DUMMY_BUCKET_BYTES)
        else:
            out.append(sum(p.numel() * p.element_size() for p in params))
    return out


def padded_shard_bytes(shape: torch.Size, element_size: int, world: int) -> int:
    """Bytes of one rank's FSDP2 shard of a parameter: dim 0 padded up to a multiple of ``world``, split evenly."""
    rows = math.ceil(shape[0] / world) if len(shape) else 1
    return rows * math.prod(shape[1:]) * element_size


def fsdp_bytes(params: list[torch.Tensor], world: int) -> tuple[int, int]:
    """Bytes this rank hands per step to FSDP2's all-gathers and reduce-scatters: ``(all-gather, reduce-scatter)``.

    With ``reshard_after_forward=False`` each group's parameters are all-gathered once per step (in the forward; they
    stay whole through the backward) and its gradients reduce-scattered once (in the backward). A rank's all-gather
    input is its padded shard of every parameter; its reduce-scatter input is every gradient whole, padded (``world``
    padded shards). Counted from the sharded parameters' global shapes; not a measurement.
    """
    shard = sum(padded_shard_bytes(p.shape, p.element_size(), world) for p in params if p.requires_grad)
    return shard, world * shard


def broadcasts_per_step(partition: Sequence[Sequence[Mapping[str, Any]]], bucket_view: bool = False) -> int:
    """How many ``broadcast`` calls every rank joins per step (one per parameter, or one bucket per rank)."""
    if bucket_view:
        return len(partition)
    return sum(len(group["params"]) for groups in partition for group in groups)


def _unwrap(optimizer: Any) -> Any:
    while hasattr(optimizer, "_optimizer"):  # Lightning's LightningOptimizer
        optimizer = optimizer._optimizer
    return optimizer


def make_optimizer(model_name: str, params: Any) -> torch.optim.Optimizer:
    """Adam (digits) or AdamW (the GPT, as in the mirrored benchmark); the sharding-engines worker uses it too."""
    if model_name == "gpt":
        return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    return torch.optim.Adam(params, lr=1e-3)


class AdamModel(BenchModel):
    """The workload's net under :func:`make_optimizer`'s optimizer."""

    @override
    def configure_optimizers(self):
        return make_optimizer(self.model_name, self.parameters())


class MemoryReading(Callback):
    """At the end of training, every rank's figures, gathered on rank 0 (every rank calls the gather)."""

    def __init__(self) -> None:
        self.ranks: list[dict[str, Any]] = []

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = _unwrap(trainer.optimizers[0])
        rank, world = trainer.global_rank, trainer.world_size
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            partition = optimizer._partition_parameters()
            bucket_view = bool(optimizer.parameters_as_bucket_view)
            sent = broadcast_bytes(partition, bucket_view)[rank]
            calls = broadcasts_per_step(partition, bucket_view)
        else:
            sent, calls = 0, 0
        fsdp2 = isinstance(trainer.strategy.model, FSDPModule)
        gather, scatter = fsdp_bytes(list(pl_module.parameters()), world) if fsdp2 else (0, 0)
        mine = {
            "rank": rank,
            "optimizer_class": type(optimizer).__name__,
            "state_bytes": optimizer_state_bytes(optimizer),
            "grad_bytes": 0.0 if fsdp2 else float(trainer.strategy.comm_bytes_per_step),
            "broadcast_bytes": sent,
            "broadcast_calls": calls,
            "allgather_bytes": gather,
            "reducescatter_bytes": scatter,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        }
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        self.ranks = gathered


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    workload = _workloads.build(spec["workload"], spec["hidden"])
    timer, reading = StepTimer(warmup=spec["warmup"]), MemoryReading()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=spec["procs"],
        strategy=ds_lightning.MirroredStrategy(
            shard_optimizer_state=spec["sharded"], sharding_engine=spec.get("engine", "zero")
        ),
        max_steps=spec["warmup"] + spec["steps"],
        callbacks=[timer, reading],
    )
    loader = DataLoader(workload.train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=True)
    trainer.fit(AdamModel(workload), train_dataloaders=loader)
    if trainer.is_global_zero:
        out = {**timer.reading(), "ranks": reading.ranks, "parameters": workload.parameters}
        Path(spec["out_dir"], "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
