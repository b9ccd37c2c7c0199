"""Small LightningModules for the digits, used by the examples, tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["DigitsClassifier", "make_mlp"]


def make_mlp(in_features: int, hidden_sizes: Sequence[int], num_classes: int) -> nn.Sequential:
    """A ReLU MLP ``in -> hidden... -> classes`` as a flat ``nn.Sequential`` (pipeline strategies split it)."""
    layers: list[nn.Module] = []
    width = in_features
    for hidden in hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class DigitsClassifier(pl.LightningModule):
    """MLP classifier for 8x8 digits that logs loss and torchmetrics accuracy.

    The network is the ``nn.Sequential`` attribute ``net``; ``pipeline_loss`` is the loss on its output, so the same
    module also fits the pipeline strategies' contract.

    Args:
        hidden_sizes: widths of the hidden layers, e.g. ``[1024, 1024]`` for the benchmark's 64-1024-1024-10 MLP.
        lr: learning rate.
        optimizer: ``"sgd"`` (with ``momentum``) or ``"adam"``.
        momentum: SGD momentum.
        num_features: input width (64 for the digits).
        num_classes: number of classes (10 for the digits).

    Raises:
        ValueError: for a non-positive width or learning rate.

    """

    def __init__(
        self,
        hidden_sizes: Sequence[int] = (128,),
        lr: float = 0.05,
        optimizer: Literal["sgd", "adam"] = "sgd",
        momentum: float = 0.9,
        num_features: int = 64,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        if any(int(h) < 1 for h in hidden_sizes):
            raise ValueError(f"hidden_sizes={list(hidden_sizes)!r} must all be >= 1.")
        if lr <= 0:
            raise ValueError(f"lr={lr!r} must be > 0.")
        if optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer={optimizer!r} must be 'sgd' or 'adam'.")
        self.save_hyperparameters()
        self.net = make_mlp(num_features, [int(h) for h in hidden_sizes], num_classes)
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits for a batch of flattened images."""
        return self.net(x)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of logits against labels."""
        return F.cross_entropy(output, target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """One optimisation step's loss; logs ``train_loss`` and ``train_acc``."""
        x, y = batch
        logits = self(x)
        loss = self.pipeline_loss(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Logs ``val_loss`` and ``val_acc``, reduced over all ranks."""
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", self.pipeline_loss(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Logs ``test_acc``, reduced over all ranks."""
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Predicted class per image."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD with momentum, or Adam."""
        if self.hparams["optimizer"] == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"])
