"""``LRScaling``: scale the learning rate with the effective batch size, with an optional linear warmup."""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.callbacks._batch_geometry import samples_per_micro_step
from ds_lightning.callbacks.gradient_accumulation import GradientAccumulation
from ds_lightning.strategies.capabilities import capabilities_of

__all__ = ["LRScaling"]

ScalingRule = Literal["linear", "sqrt"]
_SCALED_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")  # what schedulers read besides their base_lrs


class LRScaling(Callback):
    """Scale every param group's learning rate by the effective batch size over ``base_batch_size``.

    The effective batch of one optimizer step is per-device batch x data-parallel replicas (or a
    :class:`~ds_lightning.callbacks.DynamicLoadBalancer`'s global batch) x gradient accumulation, read from the
    running trainer (Lightning's ``accumulate_grad_batches`` or a
    :class:`~ds_lightning.callbacks.GradientAccumulation` schedule). ``rule="linear"`` multiplies by the ratio
    (Goyal et al. 2017), ``"sqrt"`` by its square root. The learning rates you set in ``configure_optimizers`` are
    the ones for ``base_batch_size``; your LR schedulers keep working on the scaled values.

    With ``warmup_steps > 0`` optimizer step ``t`` (0-based) uses the scaled rate times
    ``warmup_start_factor + (1 - warmup_start_factor) * t / warmup_steps`` until ``t`` reaches ``warmup_steps``.
    The warmup applies only while the optimizer steps, so schedulers never see it.

    Resuming never scales twice: the checkpoint records the factor already in its learning rates, and only the
    change (for example after the number of devices changed) is applied. Logged: ``lr_scaling/effective_batch_size``,
    ``lr_scaling/factor`` and ``lr_scaling/lr`` (the first param group's rate this step, warmup included).

    Args:
        base_batch_size: the batch size your learning rates were tuned for.
        rule: ``"linear"`` or ``"sqrt"``.
        warmup_steps: optimizer steps of linear warmup; 0 for none.
        warmup_start_factor: the fraction of the scaled rate at step 0 of the warmup, in ``(0, 1]``.

    Raises:
        ValueError: for an out-of-range option, naming the value and the fix.

    """

    def __init__(
        self,
        base_batch_size: int,
        rule: ScalingRule = "linear",
        warmup_steps: int = 0,
        warmup_start_factor: float = 0.1,
    ) -> None:
        check.integer("base_batch_size", base_batch_size, 1, "LRScaling(base_batch_size=256)")
        check.choice("rule", rule, ("linear", "sqrt"))
        check.integer("warmup_steps", warmup_steps, 0, "LRScaling(256, warmup_steps=100)", "0 turns warmup off")
        check.number(
            "warmup_start_factor", warmup_start_factor, "LRScaling(256, warmup_start_factor=0.1)", above=0, at_most=1
        )
        self.base_batch_size = base_batch_size
        self.rule = rule
        self.warmup_steps = warmup_steps
        self.warmup_start_factor = float(warmup_start_factor)
        self.applied_factor = 1.0  # the factor the optimizers' learning rates carry now
        self.effective_batch_size = 0
        self._handles: list[RemovableHandle] = []
        self._saved_lrs: list[list[float]] = []

    # --- the factor -----------------------------------------------------------------------------------------------

    def factor_for(self, effective_batch_size: int) -> float:
        """The scaling factor of ``effective_batch_size`` under this rule."""
        ratio = effective_batch_size / self.base_batch_size
        return ratio if self.rule == "linear" else math.sqrt(ratio)

    def warmup_factor(self, step: int) -> float:
        """The warmup multiplier of optimizer step ``step`` (0-based)."""
        if step >= self.warmup_steps:
            return 1.0
        return self.warmup_start_factor + (1.0 - self.warmup_start_factor) * step / self.warmup_steps

    @staticmethod
    def _accumulation(trainer: pl.Trainer) -> int:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, GradientAccumulation):
                return callback.steps_for_epoch(trainer, trainer.current_epoch)
        return int(trainer.accumulate_grad_batches)

    def _rescale(self, trainer: pl.Trainer) -> None:
        self.effective_batch_size = samples_per_micro_step(trainer, "LRScaling") * self._accumulation(trainer)
        target = self.factor_for(self.effective_batch_size)
        change = target / self.applied_factor
        if change != 1.0:
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    for key in _SCALED_KEYS:
                        if isinstance(group.get(key), (int, float)):
                            group[key] = group[key] * change
            for config in trainer.lr_scheduler_configs:
                if hasattr(config.scheduler, "base_lrs"):
                    config.scheduler.base_lrs = [lr * change for lr in config.scheduler.base_lrs]
        self.applied_factor = target

    # --- hooks ----------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.applied_factor = 1.0  # fit() builds fresh optimizers; a resumed run's factor comes from load_state_dict
        if stage == "fit" and capabilities_of(trainer.strategy).steps_optimizer_on_servers:
            raise MisconfigurationException(
                "LRScaling cannot run under ds_parameter_server: the servers own the learning rate, and an update"
                " there applies one worker's gradient, not a batch grown with the number of workers. Set the"
                " learning rate in configure_optimizers instead (under max_staleness=0 one update averages"
                " workers x batch samples)."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning restored the optimizers: a resumed run's rates already carry `applied_factor`.
        self._rescale(trainer)
        self._remove_hooks()
        if self.warmup_steps:
            for index, optimizer in enumerate(trainer.optimizers):
                self._handles.append(optimizer.register_step_pre_hook(self._warm_hook(trainer, index)))
                self._handles.append(optimizer.register_step_post_hook(self._cool_hook(index)))
            self._saved_lrs = [[] for _ in trainer.optimizers]

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rescale(trainer)  # an accumulation schedule may have changed the effective batch

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning's logger connector
        if not trainer.optimizers or not every or (trainer.global_step + 1) % every:
            return  # log only on the steps the loggers write: self.log costs about 1 ms
        lr = float(trainer.optimizers[0].param_groups[0]["lr"]) * self.warmup_factor(trainer.global_step)
        pl_module.log_dict(
            {
                "lr_scaling/effective_batch_size": float(self.effective_batch_size),
                "lr_scaling/factor": self.applied_factor,
                "lr_scaling/lr": lr,
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
            sync_dist=False,  # the same on every rank
        )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    def _warm_hook(self, trainer: pl.Trainer, index: int) -> Any:
        def warm(optimizer: Any, args: Any, kwargs: Any) -> None:
            factor = self.warmup_factor(trainer.global_step)
            self._saved_lrs[index] = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * factor

        return warm

    def _cool_hook(self, index: int) -> Any:
        def cool(optimizer: Any, args: Any, kwargs: Any) -> None:
            for group, lr in zip(optimizer.param_groups, self._saved_lrs[index], strict=False):
                group["lr"] = lr

        return cool

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- checkpoints ----------------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"applied_factor": self.applied_factor, "effective_batch_size": self.effective_batch_size}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.applied_factor = float(state_dict.get("applied_factor", 1.0))
        self.effective_batch_size = int(state_dict.get("effective_batch_size", 0))
