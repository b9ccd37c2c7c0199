"""Callbacks that record what happened inside worker processes, for tests to assert on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


class SaveParams(Callback):
    """At the end of fit, every rank writes its parameters and step count to ``{path}.rank{R}.pt``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.batches = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.batches += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
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
            "even_batches": getattr(strategy, "even_batches", None),
            "ddp_bucket_bytes_cap": getattr(model, "bucket_bytes_cap", None),
            "ddp_static_graph": getattr(model, "static_graph", None),
            "ddp_find_unused_parameters": getattr(model, "find_unused_parameters", None),
            "ddp_gradient_as_bucket_view": getattr(model, "gradient_as_bucket_view", None),
            "ddp_comm_hook": model._comm_hooks[0][0].__name__ if getattr(model, "_comm_hooks", None) else None,
        }
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(record, indent=2))
