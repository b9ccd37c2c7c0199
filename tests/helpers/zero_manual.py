"""Manual optimization with two optimizers under ds_mirrored; Lightning relaunches this script for every rank.

Usage: ``python -m tests.helpers.zero_manual OUT SHARD`` (``SHARD`` is 0 or 1); rank 0 saves the final parameters and
the optimizers' classes to ``OUT``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ds_lightning


class TwoOptimizers(pl.LightningModule):
    """Adam on the first layer every batch, SGD with momentum on the second every other batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 2)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        adam, sgd = self.optimizers()
        loss = nn.functional.cross_entropy(self.second(torch.tanh(self.first(x))), y)
        adam.zero_grad()
        sgd.zero_grad()
        self.manual_backward(loss)
        adam.step()
        if batch_idx % 2 == 0:
            sgd.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.first.parameters(), 0.01), torch.optim.SGD(self.second.parameters(), 0.1, 0.9)


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
