"""``GradientAccumulation``: accumulate micro-batches to a number of steps or to a target global batch size."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.callbacks._batch_geometry import data_parallel_size, per_device_batch_size, samples_per_micro_step
from ds_lightning.callbacks.load_balancer import DynamicLoadBalancer

__all__ = ["GradientAccumulation"]


class GradientAccumulation(Callback):
    """Sum gradients over several micro-batches before each optimizer step.

    Give either ``steps`` (micro-batches per optimizer step) or ``global_batch_size``: the samples one optimizer step
    should see across all data-parallel processes. With ``global_batch_size`` the number of micro-batches is worked
    out from the per-device batch size and the number of replicas when training starts, so running on more devices
    keeps the effective batch the same. ``schedule`` changes the value (in the same unit) from a given epoch on, e.g.
    ``{0: 64, 5: 128}``.

    Built on Lightning's own accumulation (``trainer.accumulate_grad_batches``): under ``ds_mirrored`` gradients are
    not synchronised on the micro-batches between optimizer steps, with the forward pass inside DDP's ``no_sync``.
    Under ``ds_parameter_server`` the micro-batches accumulate locally before each push; ``ds_pipeline`` runs each
    micro-batch through its schedule and steps at the window's end.

    A window cut short by the end of an epoch is averaged over the micro-batches it actually had (Lightning divides
    every loss by the full window, Lightning issue 19987), so its step equals one over that smaller batch.

    Args:
        steps: micro-batches per optimizer step.
        global_batch_size: samples per optimizer step over all data-parallel processes.
        schedule: ``{epoch: value}``; from ``epoch`` on, ``value`` replaces ``steps`` (or ``global_batch_size``).

    Raises:
        ValueError: for an out-of-range or contradictory option, naming the value and the fix.

    """

    def __init__(
        self,
        steps: int | None = None,
        global_batch_size: int | None = None,
        schedule: dict[int, int] | None = None,
    ) -> None:
        if (steps is None) == (global_batch_size is None):
            raise ValueError(
                f"Give exactly one of steps={steps!r} and global_batch_size={global_batch_size!r}, e.g."
                " GradientAccumulation(steps=4) or GradientAccumulation(global_batch_size=256)."
            )
        unit = "steps" if steps is not None else "global_batch_size"
        check.integer(unit, steps if steps is not None else global_batch_size, 1, f"GradientAccumulation({unit}=4)")
        schedule = dict(schedule or {})
        for epoch, value in schedule.items():
            if not check.is_int(epoch) or epoch < 0:
                raise ValueError(f"schedule key {epoch!r} must be an epoch number >= 0, e.g. schedule={{5: 8}}.")
            check.integer(f"schedule[{epoch}]", value, 1, f"GradientAccumulation(schedule={{{epoch}: 8}})")
        self.steps = steps
        self.global_batch_size = global_batch_size
        self.schedule = schedule
        self._window = 0  # micro-batches since the last optimizer step
        self._current = 1
        self.partial_windows = 0  # windows cut short and renormalised, for logs and tests

    def value_for_epoch(self, epoch: int) -> int:
        """The configured ``steps`` or ``global_batch_size`` in force at ``epoch``."""
        value = self.steps if self.steps is not None else self.global_batch_size
        for start in sorted(self.schedule):
            if start <= epoch:
                value = self.schedule[start]
        assert value is not None
        return value

    def steps_for_epoch(self, trainer: pl.Trainer, epoch: int) -> int:
        """Micro-batches per optimizer step at ``epoch`` on this trainer.

        Raises:
            MisconfigurationException: when the global batch size is not a whole number of micro-steps.

        """
        value = self.value_for_epoch(epoch)
        if self.steps is not None:
            return value
        per_micro_step = samples_per_micro_step(trainer, "GradientAccumulation(global_batch_size=...)")
        if value % per_micro_step:
            lower = max(per_micro_step, value // per_micro_step * per_micro_step)
            source = _describe_micro_step(trainer, per_micro_step)
            raise MisconfigurationException(
                f"GradientAccumulation(global_batch_size={value}) cannot be reached exactly: one micro-step takes"
                f" {per_micro_step} samples ({source}), and {value} is not a multiple of"
                f" {per_micro_step}. Use global_batch_size={lower} or {lower + per_micro_step}, or change the batch"
                " size or the number of devices."
            )
        return value // per_micro_step

    # --- hooks ----------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "GradientAccumulation needs automatic optimization; with manual optimization call optimizer.step()"
                " every k batches yourself."
            )
        if trainer.strategy.handles_gradient_accumulation:
            raise MisconfigurationException(
                f"GradientAccumulation cannot drive {type(trainer.strategy).__name__}, which accumulates gradients"
                " itself; configure accumulation on the strategy instead."
            )
        if trainer.accumulate_grad_batches != 1 and trainer.accumulate_grad_batches != self._current:
            raise MisconfigurationException(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and GradientAccumulation both"
                " set the accumulation; remove accumulate_grad_batches from the Trainer."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer)
        self._window = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._window += 1

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        window, self._window = self._window, 0
        k = trainer.accumulate_grad_batches
        if 0 < window < k:
            # Every loss was divided by k; this window had only `window` micro-batches.
            self.partial_windows += 1
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            param.grad.mul_(k / window)

    def _apply(self, trainer: pl.Trainer) -> None:
        self._current = self.steps_for_epoch(trainer, trainer.current_epoch)
        trainer.accumulate_grad_batches = self._current

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            trainer.accumulate_grad_batches = 1  # a later fit on this trainer starts from the Trainer's own value
            self._current = 1

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"window": self._window, "partial_windows": self.partial_windows}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._window = int(state_dict.get("window", 0))
        self.partial_windows = int(state_dict.get("partial_windows", 0))


def _describe_micro_step(trainer: pl.Trainer, per_micro_step: int) -> str:
    if any(isinstance(c, DynamicLoadBalancer) and c.plan is not None for c in trainer.callbacks):  # type: ignore[attr-defined]
        return f"the DynamicLoadBalancer's global_batch_size={per_micro_step}"
    batch = per_device_batch_size(trainer, "GradientAccumulation(global_batch_size=...)")
    return f"per-device batch {batch} x {data_parallel_size(trainer)} data-parallel processes"
