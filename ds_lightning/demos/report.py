"""A callback that measures step time and throughput and prints one summary line on rank 0."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from ds_lightning.callbacks._batch_geometry import data_parallel_size

__all__ = ["TrainingReport"]


def _batch_size(batch: Any, count: str = "samples") -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0] if count == "samples" else batch.numel())
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0], count)
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())), count)
    return 0


class TrainingReport(Callback):
    """Times every training step (forward, backward, optimizer; data loading excluded) and reports at the end of fit.

    All ranks take part in the final reduction; only rank 0 prints and writes ``output_json``.

    Args:
        warmup_steps: steps left out of the timing (first-step allocation, DDP bucket rebuild).
        output_json: where rank 0 writes the figures, or ``None``.
        monitor: the logged metric to report, e.g. ``"val_acc"`` or ``"val_ppl"``.
        count: what throughput counts: ``"samples"`` (rows of the batch's first tensor) or ``"tokens"`` (all its
            elements: a language model's token ids).

    """

    def __init__(
        self,
        warmup_steps: int = 5,
        output_json: str | None = None,
        monitor: str = "val_acc",
        count: Literal["samples", "tokens"] = "samples",
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be >= 0.")
        if count not in ("samples", "tokens"):
            raise ValueError(f"count={count!r} must be 'samples' or 'tokens' (for a language model's token ids).")
        self.warmup_steps = warmup_steps
        self.output_json = output_json
        self.monitor = monitor
        self.count = count
        self.step_times: list[float] = []
        self.samples = 0
        self._start = 0.0
        self._seen = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Start the step's clock."""
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Stop the step's clock, past the warm-up."""
        elapsed = time.perf_counter() - self._start
        self._seen += 1
        if self._seen > self.warmup_steps:
            self.step_times.append(elapsed)
            self.samples += _batch_size(batch, self.count)

    def summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Figures reduced over all ranks; a collective, so every rank must call it."""
        strategy = trainer.strategy
        local = torch.tensor([float(self.samples), sum(self.step_times)], dtype=torch.float64)
        samples = float(strategy.reduce(local[:1].to(strategy.root_device), reduce_op="sum").item())
        # The stages of one pipeline replica all see its batches: count each batch once.
        samples *= data_parallel_size(trainer) / max(trainer.world_size, 1)
        busy = float(strategy.reduce(local[1:].to(strategy.root_device), reduce_op="max").item())
        metric = trainer.callback_metrics.get(self.monitor)
        out: dict[str, Any] = {
            "strategy": type(strategy).__name__,
            "world_size": trainer.world_size,
            "steps_timed": len(self.step_times),
            "median_step_ms": 1000 * statistics.median(self.step_times) if self.step_times else None,
            f"{self.count}_per_s": samples / busy if busy > 0 else None,
            f"{self.count}_timed": samples,
            self.monitor: float(metric) if metric is not None else None,
        }
        for attr in ("comm_bytes_per_step", "uncompressed_bytes_per_step"):
            if hasattr(strategy, attr):
                out[attr] = float(getattr(strategy, attr))
        return out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Reduce, then print and write on rank 0."""
        report = self.summary(trainer)
        if not trainer.is_global_zero:
            return
        parts = [f"{report['strategy']} on {report['world_size']} process(es)"]
        if report[self.monitor] is not None:
            parts.append(f"{self.monitor}={report[self.monitor]:.4f}")
        if report[f"{self.count}_per_s"] is not None:
            parts.append(f"{report[f'{self.count}_per_s']:.0f} {self.count}/s")
            parts.append(f"median step {report['median_step_ms']:.2f} ms")
        print("[ds_lightning] " + " | ".join(parts), flush=True)
        if self.output_json:
            path = Path(self.output_json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2))
