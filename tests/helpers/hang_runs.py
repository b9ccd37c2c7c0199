"""A two-rank ``ds_mirrored`` run that hangs on purpose: ``python -m tests.helpers.hang_runs FAULT RANK STEP ROOT T``.

Faults, acted on by rank ``RANK`` at optimizer step ``STEP``:

- ``sleep``: it sleeps in ``training_step`` far past the timeout (the others wait in DDP's gradient all-reduce);
- ``skip``: the others all-reduce in ``on_train_batch_end``; it skips that and goes on to the next step, whose first
  collective is Lightning's own (its SIGTERM broadcast);
- ``desync``: the others all-reduce in ``on_train_batch_end``; it broadcasts there instead;
- ``none``: no fault (the control: the run ends, and no verdict is written).

``T`` is the strategy's timeout in seconds.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from ds_lightning.strategies import MirroredStrategy


class SleepyDigits(DigitsClassifier):
    """The digits classifier; rank ``rank`` sleeps ``seconds`` in ``training_step`` at step ``step``."""

    def __init__(self, rank: int, step: int, seconds: float) -> None:
        super().__init__(hidden_sizes=[16], lr=0.05)
        self.sleep_rank, self.sleep_step, self.seconds = rank, step, seconds

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_rank == self.sleep_rank and self.trainer.global_step == self.sleep_step:
            time.sleep(self.seconds)
        return super().training_step(batch, batch_idx)


class Misbehave(Callback):
    """The ``skip`` and ``desync`` faults (see the module's docs)."""

    def __init__(self, fault: str, rank: int, step: int) -> None:
        self.fault, self.rank, self.step = fault, rank, step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        tensor = torch.ones(4)
        if trainer.global_rank != self.rank:
            dist.all_reduce(tensor)
        elif self.fault == "desync":
            dist.broadcast(tensor, src=0)


def main(fault: str, rank: int, step: int, root: str, timeout: float) -> None:
    model: pl.LightningModule = SleepyDigits(
        rank if fault == "sleep" else -1, step, seconds=2 * timeout + 2
    )  # past the others' verdict
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MirroredStrategy(timeout=timeout),
        max_steps=step + 3,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=root,
        callbacks=[Misbehave(fault, rank, step)] if fault in ("skip", "desync") else [],
    )
    trainer.fit(model, DigitsDataModule(batch_size=16))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
