"""Keep every rank at the same number of batches, so DDP's collectives never wait for a rank that ran out of data.

Map-style loaders under Lightning's ``DistributedSampler`` already have equal lengths and pass through untouched.
Loaders whose lengths differ across ranks are capped at the shortest. Loaders without a trustworthy length
(``IterableDataset``) agree on "everyone still has a batch" with one tiny all-reduce per batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset


def _local_length(dataloader: object) -> int:
    try:
        return len(dataloader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return -1


def _is_iterable_style(dataloader: object) -> bool:
    dataset = getattr(dataloader, "dataset", None)
    return isinstance(dataset, IterableDataset) or not isinstance(dataloader, DataLoader)


class EvenBatchesLoader:
    """Wraps a dataloader so that all ranks yield the same number of batches.

    Attributes are forwarded to the wrapped loader, so Lightning still finds its sampler (``set_epoch``) and dataset.

    Args:
        dataloader: the per-rank loader.
        length: the agreed number of batches per epoch, or ``None`` when unknown.
        check_each_batch: agree with the other ranks before yielding each batch.
        device: device for the agreement tensor (CUDA under NCCL).

    """

    def __init__(self, dataloader: Any, length: int | None, check_each_batch: bool, device: torch.device) -> None:
        self.__dict__["dataloader"] = dataloader
        self.__dict__["_length"] = length
        self.__dict__["_check_each_batch"] = check_each_batch
        self.__dict__["_device"] = device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["dataloader"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets e.g. ``worker_init_fn``; it belongs on the real loader.
        setattr(self.__dict__["dataloader"], name, value)

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this loader has no agreed length")
        return self._length

    def _all_have_batch(self, has_batch: bool) -> bool:
        flag = torch.tensor([1 if has_batch else 0], dtype=torch.int32, device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.dataloader)
        produced = 0
        while self._length is None or produced < self._length:
            try:
                batch = next(iterator)
                has_batch = True
            except StopIteration:
                batch, has_batch = None, False
            if self._check_each_batch:
                if not self._all_have_batch(has_batch):
                    if has_batch:
                        warnings.warn(
                            f"ds_lightning even_batches: rank {dist.get_rank()} stopped after {produced} batches"
                            " because another rank ran out of data; its remaining batches were skipped this epoch."
                            " Give every rank the same number of samples to use them all.",
                            stacklevel=2,
                        )
                    return
            elif not has_batch:
                return
            produced += 1
            yield batch


def even_batches(dataloader: Any, device: torch.device) -> Any:
    """Return ``dataloader`` itself when all ranks agree on its length, else an :class:`EvenBatchesLoader`.

    Must be called on every rank with the process group initialised (it all-gathers the local lengths).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dataloader
    iterable = _is_iterable_style(dataloader)
    local = torch.tensor([_local_length(dataloader), int(iterable)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    lengths = [int(t[0]) for t in gathered]
    any_iterable = any(int(t[1]) for t in gathered)
    sized = all(n >= 0 for n in lengths)
    if sized and not any_iterable and len(set(lengths)) == 1:
        return dataloader
    if sized and len(set(lengths)) > 1:
        warnings.warn(
            f"ds_lightning even_batches: ranks have {lengths} batches per epoch; every rank will run {min(lengths)}"
            " so that gradient synchronisation cannot hang.",
            stacklevel=2,
        )
    return EvenBatchesLoader(
        dataloader, length=min(lengths) if sized else None, check_each_batch=any_iterable or not sized, device=device
    )
