"""scikit-learn's bundled handwritten digits (1,797 real 8x8 images) as a Lightning DataModule: no download."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["DigitsDataModule", "load_digits_tensors"]


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All digits as ``(features, labels)``: features in [0, 1] of shape ``(1797, 64)``, labels in 0..9."""
    from sklearn.datasets import load_digits

    data = load_digits()
    features = torch.tensor(data.data / 16.0, dtype=torch.float32)
    labels = torch.tensor(data.target, dtype=torch.long)
    return features, labels


class DigitsDataModule(pl.LightningDataModule):
    """Train/validation split of the digits, identical on every rank and every run with the same ``seed``.

    Args:
        batch_size: per-device batch size.
        val_fraction: share of the 1,797 images held out for validation.
        seed: seed of the split (the training order follows ``seed_everything``).
        num_workers: DataLoader worker processes; 0 keeps loading in the training process.
        shuffle: shuffle training batches each epoch.

    Raises:
        ValueError: for a batch size < 1 or a fraction outside (0, 1).

    """

    num_features = 64
    num_classes = 10

    def __init__(
        self,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} must lie strictly between 0 and 1, e.g. 0.2.")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0.")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        """Split the bundled digits (cheap, so every rank does it locally)."""
        if self.train_set is not None:
            return
        features, labels = load_digits_tensors()
        order = torch.from_numpy(np.random.RandomState(self.seed).permutation(len(labels)))
        n_val = round(len(labels) * self.val_fraction)
        val_idx, train_idx = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(features[train_idx], labels[train_idx])
        self.val_set = TensorDataset(features[val_idx], labels[val_idx])

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches; Lightning adds the ``DistributedSampler``."""
        assert self.train_set is not None
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The validation split (the digits have no separate test set)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The validation split."""
        return self.val_dataloader()
