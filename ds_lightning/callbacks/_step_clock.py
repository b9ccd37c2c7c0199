"""A callback base that drives the Trainer's shared :class:`~ds_lightning.diagnostics.step_times.StepClock`."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ds_lightning.diagnostics.step_times import step_clock

__all__ = ["ClockedCallback"]


class ClockedCallback(Callback):
    """Marks the phases of every step on the Trainer's shared clock; several such callbacks share one clock.

    A subclass that overrides one of these hooks calls ``super()`` in it (or marks the clock itself), and calls
    :meth:`watch_gradients` once the model is wrapped (``on_train_start``).
    """

    def watch_gradients(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Note when each gradient is ready, on the model the strategy trains (``trainer.model``)."""
        clock = step_clock(trainer)
        clock.watch(trainer.model if trainer.model is not None else pl_module)
        clock.watch_loop(trainer.fit_loop.epoch_loop)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step_clock(trainer).pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step_clock(trainer).pause()  # a validation run inside fit is not the next batch's data loading

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        step_clock(trainer).batch_start()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        step_clock(trainer).backward_start()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step_clock(trainer).backward_end()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step_clock(trainer).optimizer_start()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        clock = step_clock(trainer)
        clock.unwatch()
        clock.unwatch_loop()
