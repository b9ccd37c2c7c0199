"""The precision plugin :class:`~ds_lightning.callbacks.MixedPrecision` installs: Lightning's AMP, counting skips.

Lightning saves a precision plugin's state under its class name. This class moves its state to the key of Lightning's
own ``MixedPrecision`` plugin (``"MixedPrecision"``) when a checkpoint is written, and reads it from there, so a run
under the callback and one with ``Trainer(precision="16-mixed")`` resume each other's checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision as LightningAmpPlugin
from typing_extensions import override

__all__ = ["LIGHTNING_KEY", "SkipCountingAmpPlugin"]

#: where Lightning's AMP plugin keeps its loss-scaler state in a checkpoint
LIGHTNING_KEY = LightningAmpPlugin.__qualname__


class SkipCountingAmpPlugin(LightningAmpPlugin):
    """Lightning's AMP plugin; a step whose gradients overflowed (the scaler skipped it and backed off) is counted."""

    skipped_steps: int = 0

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        before = self.scaler.get_scale()
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        # The scale shrinks exactly when the scaler found inf/NaN gradients and skipped optimizer.step().
        if self.scaler.get_scale() < before:
            self.skipped_steps += 1
        return output

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        own = type(self).__qualname__
        if own in checkpoint:  # Lightning wrote it under this class's name just before this hook
            checkpoint[LIGHTNING_KEY] = checkpoint.pop(own)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Called before Lightning looks for this class's own key, which the checkpoint does not have.
        state = checkpoint.get(LIGHTNING_KEY)
        if state:
            self.load_state_dict(state)
