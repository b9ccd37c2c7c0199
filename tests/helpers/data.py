"""DataModules whose ranks see different amounts of data, to exercise the uneven-input guard."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _RankSizedStream(IterableDataset):
    def __init__(self, samples_per_rank: list[int]) -> None:
        self.samples_per_rank = samples_per_rank

    def __iter__(self):
        n = self.samples_per_rank[_rank() % len(self.samples_per_rank)]
        g = torch.Generator().manual_seed(_rank())
        for _ in range(n):
            x = torch.rand(64, generator=g)
            yield x, int(x.sum() * 10) % 10


class UnevenStreamData(pl.LightningDataModule):
    """An ``IterableDataset`` that yields ``samples_per_rank[r]`` samples on rank ``r`` (no length)."""

    def __init__(self, samples_per_rank: list[int], batch_size: int = 8) -> None:
        super().__init__()
        self.samples_per_rank = samples_per_rank
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RankSizedStream(self.samples_per_rank), batch_size=self.batch_size)


class _RankSizedMap(Dataset):
    def __init__(self, samples_per_rank: list[int]) -> None:
        self.samples_per_rank = samples_per_rank
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(max(samples_per_rank), 64, generator=g)

    def __len__(self) -> int:
        return self.samples_per_rank[_rank() % len(self.samples_per_rank)]

    def __getitem__(self, i: int):
        return self.x[i], int(self.x[i].sum() * 10) % 10


class UnevenMapData(pl.LightningDataModule):
    """Map-style data of a different length per rank; run with ``use_distributed_sampler=False``."""

    def __init__(self, samples_per_rank: list[int], batch_size: int = 8) -> None:
        super().__init__()
        self.samples_per_rank = samples_per_rank
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RankSizedMap(self.samples_per_rank), batch_size=self.batch_size, drop_last=False)


class OddLengthData(pl.LightningDataModule):
    """``n`` samples, not divisible by the world size, with ``drop_last=False``."""

    def __init__(self, n: int = 101, batch_size: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.rand(n, 64, generator=g)
        self.dataset = TensorDataset(x, (x.sum(1) * 10).long() % 10)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=False)
