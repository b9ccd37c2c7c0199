"""A quiet in-process Trainer for tests that need no second process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


def quiet_trainer(tmp_path: Path, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    """One CPU device (unless ``strategy``/``devices`` say otherwise), no logger, checkpoints, bars or summary."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)
