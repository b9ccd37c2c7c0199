"""Manual optimization with two optimizers under ds_mirrored; Lightning relaunches this script for every rank.

Usage: ``python -m tests.helpers.zero_manual OUT SHARD`` (``SHARD`` is 0 or 1); rank 0 saves the final parameters and
the optimizers' classes to ``OUT``.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import ds_lightning
from tests.helpers.models import TwoOptimizers


def main(out: str, shard: bool) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ds_lightning.MirroredStrategy(shard_optimizer_state=shard),
        max_epochs=2, logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    model = TwoOptimizers()
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        optimizers = [type(o).__name__ for o in trainer.optimizers]
        torch.save({"state_dict": model.state_dict(), "optimizers": optimizers}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1")
