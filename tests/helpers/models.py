"""A user-side LightningModule and DataModule, reachable by class path like a user's own package."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyModule(pl.LightningModule):
    """BoringModel-sized: Linear(32, 2)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(32, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class TinyData(pl.LightningDataModule):
    def __init__(self, n: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 32, generator=g)
        self.dataset = TensorDataset(x, (x[:, 0] > 0).long())
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)
