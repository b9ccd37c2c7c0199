"""The precision plugin :class:`~ds_lightning.callbacks.MixedPrecision` installs: Lightning's, counting skipped steps.

The class keeps Lightning's name, so its loss-scaler state is saved under the same checkpoint key
(``"MixedPrecision"``) as with ``Trainer(precision="16-mixed")``, and either one resumes the other's checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision
from typing_extensions import override


class MixedPrecision(_LightningMixedPrecision):
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
