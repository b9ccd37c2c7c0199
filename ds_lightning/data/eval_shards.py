"""Evaluation shards that hold every sample exactly once: Lightning's ``DistributedSampler`` shards, minus its padding.

For validation and test, Lightning gives each data-parallel rank a ``DistributedSampler`` shard, which repeats the
first samples until every rank has as many as the largest shard: 359 samples on 2 ranks become 360, and the repeated
one is counted twice by every metric. Evaluation needs no equal shard sizes (a DDP forward in eval runs no collective
after the first batch), so :func:`unpadded_eval_loader` keeps the same shards in the same order and drops the repeats.
Ranks may then run different numbers of batches; :func:`uneven_batch_counts` says so, for a strategy to refuse
per-batch collectives that would wait for a rank that has finished. Prediction already uses Lightning's unpadded
``UnrepeatedDistributedSampler``, and is left as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.distributed import ReduceOp
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

__all__ = [
    "EvalShardError",
    "UnpaddedShard",
    "exact_mean_input",
    "shard_sizes",
    "uneven_batch_counts",
    "unpadded_eval_loader",
]


class EvalShardError(ValueError):
    """An evaluation set that cannot be split so that every rank evaluates at least one sample."""


def shard_sizes(total: int, num_replicas: int) -> list[int]:
    """Each rank's number of samples when ``total`` samples are dealt round-robin without padding."""
    return [len(range(rank, total, num_replicas)) for rank in range(num_replicas)]


def batch_counts(sizes: Iterable[int], batch_size: int, drop_last: bool) -> list[int]:
    """Each rank's number of batches for its shard size."""
    return [size // batch_size if drop_last else -(-size // batch_size) for size in sizes]


class UnpaddedShard(Sampler[Any]):
    """A ``DistributedSampler``'s shard without the repeated samples that pad it to the largest shard's size.

    The wrapped sampler keeps its order (shuffle, seed, epoch): it deals position ``p`` of its padded index list to rank
    ``p % num_replicas``, and only positions from ``len(dataset)`` on are repeats, so this yields what it yields and
    stops at the first repeat. Lightning's ``set_epoch`` reaches the wrapped sampler.

    Args:
        sampler: the padded shard (``drop_last=False``), as Lightning injects it.

    """

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler = sampler
        self.total = len(sampler.dataset)  # type: ignore[arg-type]
        self.sizes = shard_sizes(self.total, sampler.num_replicas)

    def __len__(self) -> int:
        return self.sizes[self.sampler.rank]

    def __iter__(self) -> Iterator[Any]:
        for _, index in zip(range(len(self)), self.sampler, strict=False):
            yield index

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler (a shuffled order changes with the epoch)."""
        self.sampler.set_epoch(epoch)


def _pads(sampler: object, num_replicas: int, rank: int) -> bool:
    """Whether ``sampler`` is a padded ``DistributedSampler`` shard of exactly this data-parallel layout."""
    return (
        isinstance(sampler, DistributedSampler)
        and isinstance(sampler.dataset, Sized)
        and not sampler.drop_last
        and (sampler.num_replicas, sampler.rank) == (num_replicas, rank)
        and sampler.total_size > len(sampler.dataset)
    )


def unpadded_eval_loader(dataloader: Any, num_replicas: int, rank: int, strategy_name: str) -> Any:
    """``dataloader`` with its padded ``DistributedSampler`` shard replaced by an :class:`UnpaddedShard`.

    A loader without such a shard (unsharded, an iterable dataset, a custom batch sampler, ``drop_last=True`` on the
    sampler, a set that divides evenly, or prediction's already unpadded shard) comes back as it is. The loader is a
    shallow copy: the user's own objects are not changed.

    Raises:
        EvalShardError: when some rank's unpadded shard has no batch (fewer samples than ranks), decided from the set's
            size alone so that every rank raises before any collective.

    """
    batches = getattr(dataloader, "batch_sampler", None)
    sampler = getattr(batches, "sampler", None)
    if not isinstance(dataloader, DataLoader) or not isinstance(sampler, DistributedSampler):
        return dataloader
    if sampler.num_replicas != num_replicas or not isinstance(sampler.dataset, Sized):
        return dataloader
    total, batch_size, drop_last = (
        len(sampler.dataset),
        getattr(batches, "batch_size", 1),
        getattr(batches, "drop_last", False),
    )
    if min(batch_counts(shard_sizes(total, num_replicas), batch_size or 1, drop_last)) == 0 and total > 0:
        # Lightning's loop refuses a rank without batches, and one that skipped the loop would miss the epoch's syncs.
        fix = f"Trainer(devices={total})" if total < num_replicas else "drop_last=False"
        raise EvalShardError(
            f"{strategy_name}: the evaluation set has {total} sample(s) (batch_size={batch_size},"
            f" drop_last={drop_last}) for {num_replicas} data-parallel ranks, so some rank would have no batch to"
            " evaluate (Lightning's DistributedSampler would repeat samples instead, counting them twice). Evaluate"
            f" on fewer processes or with more samples; here {fix} would do."
        )
    if type(batches) is not BatchSampler or not _pads(sampler, num_replicas, rank):
        return dataloader
    shard = UnpaddedShard(sampler)
    unpadded = copy.copy(dataloader)
    # DataLoader refuses to set these once built; the copy is Lightning's to use, and its length follows them.
    object.__setattr__(unpadded, "batch_sampler", BatchSampler(shard, batches.batch_size, batches.drop_last))
    object.__setattr__(unpadded, "sampler", shard)
    return unpadded


def uneven_batch_counts(dataloader: object, cap: int | None = None) -> list[int] | None:
    """Every rank's number of batches from this unpadded loader when they differ, else ``None``.

    Args:
        dataloader: a loader from :func:`unpadded_eval_loader` (any other loader gives ``None``).
        cap: the most batches the loop runs per rank (``limit_*_batches`` or the sanity check), if any.

    """
    batches = getattr(dataloader, "batch_sampler", None)
    shard = getattr(batches, "sampler", None)
    if not isinstance(batches, BatchSampler) or not isinstance(shard, UnpaddedShard):
        return None
    counts = batch_counts(shard.sizes, batches.batch_size or 1, batches.drop_last)
    if cap is not None:
        counts = [min(count, cap) for count in counts]
    return counts if len(set(counts)) > 1 else None


def exact_mean_input(tensor: Any, reduce_op: object) -> Any:
    """``tensor`` in float64 when it is an integer tensor about to be averaged across ranks, else itself.

    Lightning averages by summing and dividing by the world size in place, which truncates an integer tensor: the
    sample count behind ``self.log(..., sync_dist=True)``'s epoch mean (359 samples on 2 ranks average 179, not 179.5)
    then skews the logged mean (0.3101 instead of 0.3092). Lightning uses the returned value, so a float copy is exact.
    """
    averaging = reduce_op == ReduceOp.AVG or (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"))
    if averaging and isinstance(tensor, torch.Tensor) and not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor.to(torch.float64)
    return tensor
