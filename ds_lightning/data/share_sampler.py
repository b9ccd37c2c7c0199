"""A batch sampler that gives each rank its share of every global batch, following a :class:`SharePlan`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from ds_lightning.data.share_plan import SharePlan, split_sizes


class _Cursor(Protocol):
    def take(self) -> tuple[int, int] | None: ...


class _EpochSetter:
    """The batch sampler's ``sampler``: Lightning calls ``set_epoch`` there, not on the batch sampler itself."""

    def __init__(self, owner: ShareBatchSampler) -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class ShareBatchSampler:
    """Yield this rank's indices of each global batch: a contiguous slice of size ``plan.sizes_at(batch)[rank]``.

    Every rank walks the same permutation (seeded like ``DistributedSampler``: ``seed + epoch``), so the slices of
    one step never overlap and, over an epoch, every sample is drawn once. Every rank yields the same number of
    batches. The last, shorter global batch is divided in the same proportions; fewer samples than ranks are dropped.

    Args:
        num_samples: the dataset's length.
        plan: the shared plan of sizes.
        rank: this data-parallel rank.
        shuffle: permute the samples every epoch.
        seed: the permutation's base seed.
        first_batch: returns the run-wide index of this epoch's first batch (read when an epoch's iteration starts).

    A ``cursor`` (set by :class:`~ds_lightning.callbacks.BackupAndRestore`) may start one iteration at a saved
    ``(epoch, samples)``: the iteration then yields the rest of that epoch, from the sample after the last one trained.

    """

    def __init__(
        self,
        num_samples: int,
        plan: SharePlan,
        rank: int,
        shuffle: bool,
        seed: int,
        first_batch: Callable[[], int],
    ) -> None:
        self.num_samples = num_samples
        self.plan = plan
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.first_batch = first_batch
        self.epoch = 0
        self.cursor: _Cursor | None = None
        self.sampler = _EpochSetter(self)

    @property
    def batch_size(self) -> int:
        """This rank's size in a full global batch under the first sizes (every rank's, unless balanced)."""
        return self.plan.sizes_at(0)[self.rank]

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (Lightning calls this at every epoch start)."""
        self.epoch = epoch

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.plan.global_batch_size)
        return full + (1 if rest >= self.plan.world_size else 0)

    def sizes(self, batch: int, total: int) -> list[int]:
        """Every rank's size in a global batch of ``total`` samples at run-wide batch index ``batch``."""
        sizes = self.plan.sizes_at(batch)
        return sizes if total == sum(sizes) else split_sizes(total, [float(s) for s in sizes], 1)

    def __iter__(self) -> Iterator[list[int]]:
        # Read the resume point here, not in set_epoch: with workers, Lightning creates the iterator before it sets
        # the epoch of a resumed run.
        resume = self.cursor.take() if self.cursor is not None else None
        epoch, skip = resume if resume is not None else (self.epoch, 0)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        start = self.first_batch()
        size = self.plan.global_batch_size
        for step in range(skip // size, len(self)):
            chunk = order[max(step * size, skip) : (step + 1) * size]
            sizes = self.sizes(start + step, len(chunk))
            offset = sum(sizes[: self.rank])
            yield chunk[offset : offset + sizes[self.rank]]
