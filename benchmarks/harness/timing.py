"""The one step clock every benchmark worker uses."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class StepTimer(Callback):
    """Times every training step on its own rank (batch start to end; data loading excluded), keeping each step's loss
    and wall-clock span, and every epoch's time up to its last batch's end. ``warmup`` steps are left out of the
    median; ``cuda_sync`` (on under CUDA) synchronises at both ends so the clock covers the kernels."""

    def __init__(self, warmup: int = 0, cuda_sync: bool | None = None) -> None:
        if warmup < 0:
            raise ValueError(f"StepTimer(warmup={warmup}) must be >= 0.")
        self.warmup = warmup
        self.cuda_sync = cuda_sync
        self.step_ms: list[float] = []
        self.loss: list[float | None] = []
        self.spans: list[tuple[float, float]] = []  # (start, end), time.time(), to line up ranks and processes
        self.epoch_s: list[float] = []
        self._start = 0.0
        self._wall = 0.0
        self._epoch_start = 0.0
        self._last_end: float | None = None

    def _sync(self, module: pl.LightningModule) -> None:
        on = self.cuda_sync if self.cuda_sync is not None else module.device.type == "cuda"
        if on:
            torch.cuda.synchronize(module.device)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()
        self._last_end = None

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._last_end is not None:
            self.epoch_s.append(self._last_end - self._epoch_start)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._sync(pl_module)
        self._wall = time.time()
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(pl_module)
        self._last_end = time.perf_counter()
        self.step_ms.append(1000 * (self._last_end - self._start))
        self.spans.append((self._wall, time.time()))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.loss.append(float(loss) if loss is not None else None)

    @property
    def timed_ms(self) -> list[float]:
        """Step times past the warm-up (all of them when there are no more)."""
        return self.step_ms[self.warmup :] or self.step_ms

    def reading(self) -> dict[str, Any]:
        """This rank's figures, JSON-ready: every step's time and loss, and the median of the timed steps."""
        timed = self.timed_ms
        return {
            "step_ms": self.step_ms,
            "loss": self.loss,
            "spans": self.spans,
            "epoch_s": self.epoch_s,
            "warmup": self.warmup,
            "median_step_ms": statistics.median(timed) if timed else None,
        }
