"""One memory-benchmark run: one mode (``modes.py``: plain / zero / fsdp2 / ZeRO-3 / ZeRO-3 + offload ``ds_mirrored``,
or Lightning's FSDPStrategy / DeepSpeedStrategy) on N CPU processes.

Started by ``driver.py`` with a JSON spec. After training every rank reads its own figures and rank 0 gathers them into
``result.json``; with ``"checkpoint"`` the ranks then save a sharded and a full checkpoint, timed, with each rank's
resident-set growth during each save (see ``README.md``).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import workloads as _workloads
from benchmarks.harness.timing import StepTimer
from benchmarks.harness.trainer import quiet_trainer
from benchmarks.memory import meters
from benchmarks.memory.modes import MODES, make_strategy
from benchmarks.mirrored.worker import BenchModel
from benchmarks.pipeline.worker import ActivationMeter
from benchmarks.sharding_engines.common import broadcast_bytes, broadcasts_per_step, fsdp_bytes, make_optimizer
from ds_lightning.demos import TiedGPT
from ds_lightning.sharding import optimizer_state_bytes
from ds_lightning.sharding.zero3 import local_state_bytes

CHECKPOINT_KINDS = ("sharded", "full")  # sharded first: the full save's gather cannot lower its reading


def build(spec: dict[str, Any]) -> _workloads.Workload:
    """The spec's workload; the GPT as :class:`~ds_lightning.demos.TiedGPT`'s network (a ModuleList, a tied head)."""
    workload = _workloads.build(spec["workload"], spec["hidden"])
    if workload.name == "gpt":
        shape = {k: v for k, v in spec["workload"].items() if k in _workloads.GPT_DEFAULTS}
        torch.manual_seed(0)
        workload.net = TiedGPT(**{**_workloads.GPT_DEFAULTS, **shape}).net  # type: ignore[assignment]
    return workload


def wrap_units(net: nn.Module) -> set[type]:
    """The classes Lightning's FSDPStrategy wraps: a layer stack's members' (a GPT's blocks, an MLP's layers)."""
    return {
        type(m)
        for c in net.modules()
        if isinstance(c, (nn.Sequential, nn.ModuleList))
        for m in c
        if next(m.parameters(), None) is not None
    }


class MeteredModel(BenchModel):
    """The workload under its optimizer, with what autograd saves in the forward counted per step."""

    def __init__(self, workload: _workloads.Workload) -> None:
        super().__init__(workload)
        self.meter = ActivationMeter()
        self.activation_peaks: list[int] = []

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.meter.reset_peak()
        with meters.counting_activations(self.meter):
            loss = self.loss(self.net(x), y)
        self.activation_peaks.append(self.meter.peak)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.model_name, self.parameters())


def _inner(optimizer: Any) -> Any:
    while hasattr(optimizer, "_optimizer"):  # Lightning's LightningOptimizer
        optimizer = optimizer._optimizer
    return optimizer


def _gather(mine: dict[str, Any], world: int) -> list[Any]:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return gathered


class MemoryReading(Callback):
    """Every rank's figures at the end of training, gathered on rank 0 (every rank joins the gather)."""

    def __init__(self, reshards: bool, warmup: int) -> None:
        self.reshards, self.warmup = reshards, warmup
        self.ranks: list[dict[str, Any]] = []

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = _inner(trainer.optimizers[0])
        rank, world = trainer.global_rank, trainer.world_size
        sent, calls = 0, 0
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            partition = optimizer._partition_parameters()  # type: ignore[attr-defined]
            bucket_view = bool(optimizer.parameters_as_bucket_view)
            sent, calls = broadcast_bytes(partition, bucket_view)[rank], broadcasts_per_step(partition, bucket_view)
        fsdp2 = isinstance(trainer.strategy.model, FSDPModule)
        gather, scatter = fsdp_bytes(list(pl_module.parameters()), world) if fsdp2 else (0, 0)
        local = local_state_bytes(pl_module, [optimizer])
        assert isinstance(pl_module, MeteredModel)
        timed = pl_module.activation_peaks[self.warmup :] or pl_module.activation_peaks
        mine = {
            "rank": rank,
            "optimizer_class": type(optimizer).__name__,
            "state_bytes": optimizer_state_bytes(optimizer),
            "param_bytes": local["parameters"],
            "grad_bytes_local": local["gradients"],
            "activation_bytes": max(timed, default=0),
            "allreduce_bytes": float(getattr(trainer.strategy, "comm_bytes_per_step", 0.0)) if not fsdp2 else 0.0,
            "broadcast_bytes": sent,
            "broadcast_calls": calls,
            # resharding gathers every unit twice a step: in the forward and again in the backward
            "allgather_bytes": gather * (2 if self.reshards else 1),
            "reducescatter_bytes": scatter,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        }
        self.ranks = _gather(mine, world)


class CheckpointSaves(Callback):
    """After the reading: ``trainer.save_checkpoint`` sharded, then full; each rank's time and resident-set growth.

    The strategy was built with ``state_dict_type="sharded"``; the full save sets the attribute to ``"full"`` (the
    strategy reads it at save time). The growth is ``VmHWM`` after the save less ``VmRSS`` before it, ``VmHWM`` reset
    to the resident set first (``/proc/self/clear_refs``).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.saves: list[dict[str, Any]] = []

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for kind in CHECKPOINT_KINDS:
            trainer.strategy.state_dict_type = kind  # type: ignore[attr-defined]
            path = self.folder / f"{kind}.ckpt"
            dist.barrier()
            meters.malloc_trim()
            resettable = meters.reset_peak_rss()
            before = meters.rss_kib()
            start, error = time.perf_counter(), None
            try:
                trainer.save_checkpoint(path)
            except Exception as exc:  # a save that fails is a result: say why on the page
                error = f"{type(exc).__name__}: {exc}"[:300]
            seconds = time.perf_counter() - start
            growth = (meters.rss_kib("VmHWM") - before) * 1024 if resettable else None
            mine = {"rank": trainer.global_rank, "seconds": seconds, "growth_bytes": growth, "error": error}
            ranks = _gather(mine, trainer.world_size)
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else None
            if path.is_file():
                size = path.stat().st_size
            self.saves.append({"kind": kind, "ranks": ranks, "disk_bytes": size})


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    workload = build(spec)
    mode = spec.get("mode", "plain")
    checkpoint: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if spec.get("checkpoint"):
        extra["state_dict_type"] = "sharded"
    try:
        strategy = make_strategy(mode, wrap_units(workload.net), spec.get("extra_path", ""), **extra)
    except TypeError as exc:  # MirroredStrategy without state_dict_type yet: train, and say why nothing was saved
        if not extra:
            raise
        checkpoint["unavailable"] = f"not available yet: {type(exc).__name__}: {exc}"
        strategy = make_strategy(mode)
    timer, reading = StepTimer(warmup=spec["warmup"]), MemoryReading(MODES[mode].shards_parameters, spec["warmup"])
    callbacks: list[Callback] = [timer, reading]
    saves = CheckpointSaves(Path(spec["out_dir"]))
    if spec.get("checkpoint") and not checkpoint:
        callbacks.append(saves)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=spec["procs"],
        strategy=strategy,
        max_steps=spec["warmup"] + spec["steps"],
        callbacks=callbacks,
    )
    loader = DataLoader(workload.train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=True)
    trainer.fit(MeteredModel(workload), train_dataloaders=loader)
    if trainer.is_global_zero:
        if spec.get("checkpoint"):
            checkpoint.setdefault("saves", saves.saves)
        out = {**timer.reading(), "ranks": reading.ranks, "parameters": workload.parameters, "checkpoint": checkpoint}
        Path(spec["out_dir"], "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
