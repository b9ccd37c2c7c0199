"""The quiet Lightning Trainer every benchmark worker builds: nothing runs or prints but the training it times."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

#: no logger, checkpoints, progress bar or model summary; no validation (so no sanity check either)
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
}


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """``pl.Trainer(**kwargs)`` with :data:`QUIET`'s settings underneath (``kwargs`` override them)."""
    return pl.Trainer(**{**QUIET, **kwargs})
