"""A user-side LightningModule and DataModule, reachable by class path like a user's own package."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ds_lightning.demos import DigitsClassifier


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


class DigitsWithStepLR(DigitsClassifier):
    """The digits classifier with plain SGD and a per-step ``StepLR`` (halves the rate every ``lr_step_size`` steps)."""

    def __init__(self, hidden_sizes: list[int] | None = None, lr: float = 0.05, lr_step_size: int = 3) -> None:
        super().__init__(hidden_sizes=tuple(hidden_sizes or [32]), lr=lr, momentum=0.0)
        self.lr_step_size = lr_step_size

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=self.lr_step_size, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class OverflowingModule(TinyModule):
    """TinyModule whose loss is multiplied by inf at optimizer step ``inf_at_step``, so its gradients overflow."""

    def __init__(self, lr: float = 0.1, inf_at_step: int = 2) -> None:
        super().__init__(lr=lr)
        self.inf_at_step = inf_at_step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step == self.inf_at_step else loss


class SlowRankDigits(DigitsClassifier):
    """The digits classifier (plain SGD) whose ``slow_rank`` sleeps ``delay_ms`` per sample in every training step."""

    def __init__(
        self, hidden_sizes: list[int] | None = None, lr: float = 0.1, slow_rank: int = 1, delay_ms: float = 0.0
    ):
        super().__init__(hidden_sizes=tuple(hidden_sizes or [32]), lr=lr, momentum=0.0)
        self.slow_rank = slow_rank
        self.delay_ms = delay_ms

    def training_step(self, batch, batch_idx):
        if self.delay_ms and self.global_rank == self.slow_rank:
            time.sleep(self.delay_ms * len(batch[0]) / 1000)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])


class TwoLayers(pl.LightningModule):
    """``Linear - tanh - Linear`` under Adam (automatic optimization), seeded in ``__init__``; records its logits'
    dtype, which autocast decides."""

    def __init__(self, sizes: tuple[int, int, int] = (8, 8, 2)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(sizes[0], sizes[1]), nn.Linear(sizes[1], sizes[2])
        self.logits_dtype = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.logits_dtype = str(logits.dtype)
        return nn.functional.cross_entropy(logits.float(), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class TwoOptimizers(TwoLayers):
    """Manual optimization: Adam on the first layer every batch, SGD with momentum on the second every other batch."""

    def __init__(self, sizes: tuple[int, int, int] = (8, 8, 2)) -> None:
        super().__init__(sizes)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        adam, sgd = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        adam.zero_grad()
        sgd.zero_grad()
        self.manual_backward(loss)
        adam.step()
        if batch_idx % 2 == 0:
            sgd.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.first.parameters(), 0.01), torch.optim.SGD(self.second.parameters(), 0.1, 0.9)
