"""Callbacks that record what happened inside worker processes, for tests to assert on."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter, Callback
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ds_lightning.sharding import optimizer_state_bytes


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class SaveParams(Callback):
    """At the end of fit, every rank writes its parameters and step count to ``{path}.rank{R}.pt``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.batches = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.batches += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # FSDP2 holds DTensor shards: gather each whole (a collective, and every rank ends training here).
        state = {k: _whole(v).detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        out = {
            "state_dict": state,
            "global_step": trainer.global_step,
            "batches_this_run": self.batches,
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
        }
        torch.save(out, f"{self.path}.rank{trainer.global_rank}.pt")


class RecordStrategy(Callback):
    """Rank 0 writes the live strategy's and DDP model's settings as JSON when training starts."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        model = strategy.model
        env = strategy.cluster_environment
        record = {
            "strategy": type(strategy).__name__,
            "environment": type(env).__name__,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "pg_timeout_s": strategy._timeout.total_seconds() if strategy._timeout is not None else None,
            "start_method": getattr(strategy, "_start_method", None),
            "gradient_compression": getattr(strategy, "gradient_compression", None),
            "auto_interval": getattr(strategy, "auto_interval", None),
            "even_batches": getattr(strategy, "even_batches", None),
            "ddp_bucket_bytes_cap": getattr(model, "bucket_bytes_cap", None),
            "ddp_static_graph": getattr(model, "static_graph", None),
            "ddp_find_unused_parameters": getattr(model, "find_unused_parameters", None),
            "ddp_gradient_as_bucket_view": getattr(model, "gradient_as_bucket_view", None),
            "ddp_comm_hook": model._comm_hooks[0][0].__name__ if getattr(model, "_comm_hooks", None) else None,
        }
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(record, indent=2))


class RecordSteps(Callback):
    """Every rank records each optimizer step's learning rate (as the optimizer applies it) and, at the end, the
    accumulation and gradient-synchronisation counts; written as JSON to ``{path}.rank{R}.json``.

    List it after the callbacks under test: its optimizer pre-hook then runs after theirs.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.lrs: list[list[float]] = []  # [global_step, lr of param group 0]
        self.micro_batches = 0
        self.batch_sizes: list[int] = []
        self.sync_rounds: int | None = None  # gradient all-reduce rounds, counted by a comm hook under plain DDP
        self._handle: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def record(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.lrs.append([trainer.global_step, float(optimizer.param_groups[0]["lr"])])

        self._handle = trainer.optimizers[0].register_step_pre_hook(record)
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel) and not getattr(model, "_comm_hooks", None):
            self.sync_rounds = 0

            def count(state, bucket):  # no annotations: DDP checks them at runtime
                if bucket.is_last():
                    self.sync_rounds += 1
                return default_hooks.allreduce_hook(state, bucket)

            model.register_comm_hook(None, count)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self.micro_batches += 1
        self.batch_sizes.append(len(batch[0]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._handle is not None:
            self._handle.remove()
        compressor = getattr(trainer.strategy, "_compressor", None)
        accumulation = [c for c in trainer.callbacks if type(c).__name__ == "GradientAccumulation"]
        record = {
            "global_step": trainer.global_step,
            "micro_batches": self.micro_batches,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "partial_windows": accumulation[0].partial_windows if accumulation else None,
            "sync_rounds": self.sync_rounds if self.sync_rounds is not None else getattr(compressor, "rounds", None),
            "lrs": self.lrs,
            "batch_sizes": self.batch_sizes,
        }
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


class RecordWire(Callback):
    """Rank 0 writes, at the end of fit, what ds_mirrored's comm hook handed to collectives, as JSON at ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wire = trainer.strategy._compressor.wire
        record = {
            "global_step": trainer.global_step,
            "steps": wire.steps if wire else None,
            "last_step_bytes": wire.last_step_bytes if wire else None,
            "dtypes": sorted(wire.dtypes) if wire else None,
            "comm_bytes_per_step": trainer.strategy.comm_bytes_per_step,
            "uncompressed_bytes_per_step": trainer.strategy.uncompressed_bytes_per_step,
        }
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(record))


class RecordAuto(Callback):
    """Every rank writes, at the end of fit, the auto compression's decisions as JSON at ``{path}.rank{R}.json``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        auto = trainer.strategy.auto_compression
        record = {
            "interval": auto.interval,
            "choice": auto.choice,
            "step": auto.step,
            "decisions": [
                {"step": d.step, "choice": d.choice, "probed": d.probed, "predicted_s": d.predicted_s}
                for d in auto.decisions
            ],
            "figures": auto.figures.as_dict() if auto.figures is not None else None,
        }
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


class RecordMetrics(Callback):
    """Rank 0 writes the logged metrics (already reduced over ranks) as JSON at ``path`` after validate or test."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero:
            metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
            Path(self.path).write_text(json.dumps(metrics))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer)


class SavePredictions(BasePredictionWriter):
    """Every rank saves its predictions and their dataset indices to ``{path}.rank{R}.pt`` after predict."""

    def __init__(self, path: str) -> None:
        super().__init__(write_interval="epoch")
        self.path = path

    def write_on_epoch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Any, batch_indices: Any
    ) -> None:
        out = {"predictions": predictions, "batch_indices": batch_indices, "world_size": trainer.world_size}
        torch.save(out, f"{self.path}.rank{trainer.global_rank}.pt")


class Heartbeat(Callback):
    """Every rank writes its global step to ``{path}.rank{R}`` after each batch, then sleeps ``delay_s``.

    Lets a test act at a known point of a run (cut a link after step 5) and stretches training to outlast the action.
    """

    def __init__(self, path: str, delay_s: float = 0.0) -> None:
        self.path = path
        self.delay_s = delay_s

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        target = f"{self.path}.rank{trainer.global_rank}"
        Path(f"{target}.tmp").write_text(str(trainer.global_step))
        os.replace(f"{target}.tmp", target)  # readers never see a half-written number
        time.sleep(self.delay_s)


class KillAt(Callback):
    """Rank ``rank`` SIGKILLs itself after training step ``step``, in torchrun's first round only (none outside it)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step = step
        self.rank = rank

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first_round and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordOptimizerState(Callback):
    """At the end of fit, every rank writes the bytes of the optimizer state it holds, and the optimizer's class, to
    ``{path}.rank{R}.json``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        local = getattr(optimizer, "optim", optimizer)  # the one that steps, under sharding
        record = {
            "state_bytes": optimizer_state_bytes(optimizer),
            "optimizer": type(optimizer).__name__,
            "local_optimizer": type(local).__name__,
            "local_params": sum(p.numel() for group in local.param_groups for p in group["params"]),
            "local_lr": float(local.param_groups[0]["lr"]),
        }
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


class RecordGradientSync(Callback):
    """Counts, per rank, the calls that switch FSDP2's gradient synchronisation off and on (the sharded
    LightningModule's ``set_requires_gradient_sync``); writes them as JSON to ``{path}.rank{R}.json`` at the end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls = {"off": 0, "on": 0}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        real = pl_module.set_requires_gradient_sync  # AttributeError unless fully_shard ran on the module

        def counting(requires_gradient_sync: bool, **kwargs: Any) -> None:
            self.calls["on" if requires_gradient_sync else "off"] += 1
            real(requires_gradient_sync, **kwargs)

        pl_module.set_requires_gradient_sync = counting

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(self.calls))


class SlowLink(Callback):
    """A test-side seam for ``gradient_compression="auto"``: from the start of training, every decision uses the
    figures of a slow link (latency 100 us, ``bandwidth`` bytes/s) instead of the loopback probe's, so auto picks a
    compression. Every rank writes the choice and step count it starts training with to ``{path}.rank{R}.json``
    (after a resume: what the checkpoint restored)."""

    def __init__(self, path: str, bandwidth: float = 1e5) -> None:
        self.path = path
        self.bandwidth = bandwidth

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from ds_lightning.comm.auto import AllReduceFit, LinkFigures

        auto = trainer.strategy.auto_compression
        link = AllReduceFit(latency_s=1e-4, bandwidth=self.bandwidth)
        auto.override = LinkFigures(trainer.world_size, link, link, {})
        record = {"choice": auto.choice, "step": auto.step}
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


class RecordPlacement(Callback):
    """Every training rank writes where it runs to ``{path}.rank{R}.json``: host name, environment, world and nodes."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        env = trainer.strategy.cluster_environment if hasattr(trainer.strategy, "cluster_environment") else None
        record = {
            "host": socket.gethostname(),
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "strategy": type(trainer.strategy).__name__,
            "environment": type(env).__name__ if env is not None else None,
            "environment_bases": [c.__name__ for c in type(env).__mro__] if env is not None else [],
            "num_workers": getattr(trainer.strategy, "num_workers", None),
            "num_servers": getattr(trainer.strategy, "num_servers", None),
        }
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(record))
