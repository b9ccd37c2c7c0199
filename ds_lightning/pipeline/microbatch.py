"""Micro-batching, one engine for ``ds_pipeline`` and ``ds_model_parallel``.

A batch is cut along dim 0 with ``torch.tensor_split`` (as torch's pipeline schedules cut it); here live the rules
around that: how many micro-batches a batch gets, running them through local stages in GPipe clock order, padding an
evaluation batch, and refusing or trimming training batches that do not split evenly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ds_lightning.pipeline.clock import clock_cycles

__all__ = ["DropPartialBatches", "check_divisible", "fit_loader", "pad_rows", "run_clocked", "scatter"]


def scatter(x: Tensor, n_microbatches: int) -> list[Tensor]:
    """Cut ``x`` along dim 0 into ``n_microbatches`` parts, or one per row when it has fewer rows."""
    return list(torch.tensor_split(x, max(1, min(n_microbatches, x.shape[0]))))


def run_clocked(
    stages: Sequence[Callable[[Tensor], Tensor]],
    devices: Sequence[torch.device],
    x: Tensor,
    n_microbatches: int,
    recompute: bool = False,
) -> Tensor:
    """Run ``x``'s micro-batches through ``stages`` in GPipe clock order; the output comes back on ``devices[0]``.

    Args:
        stages: one callable per stage.
        devices: the device of each stage; a micro-batch moves to it before the stage runs.
        x: the batch, split along dim 0.
        n_microbatches: see :func:`scatter`.
        recompute: keep only each stage's input and recompute the rest in the backward pass.

    """
    chunks = scatter(x.to(devices[0]), n_microbatches)
    for tick in clock_cycles(len(chunks), len(stages)):
        for i, j in tick:
            h = chunks[i].to(devices[j])
            chunks[i] = checkpoint(stages[j], h, use_reentrant=False) if recompute else stages[j](h)
    return torch.cat(chunks).to(devices[0])


def check_divisible(rows: int, n_microbatches: int) -> None:
    """Refuse a training batch whose rows do not split into equal micro-batches.

    Raises:
        ValueError: naming the row count and the fix.

    """
    if rows % n_microbatches:
        raise ValueError(
            f"A training batch has {rows} rows, which n_microbatches={n_microbatches} does not divide. "
            "Use a batch size that is a multiple of n_microbatches (map-style loaders drop only a partial last "
            "batch automatically)."
        )


def pad_rows(x: Tensor, n_microbatches: int) -> Tensor:
    """Repeat the last row until the rows are a multiple of ``n_microbatches`` (at least ``n_microbatches``)."""
    rows = x.shape[0]
    padded = max(n_microbatches, math.ceil(rows / n_microbatches) * n_microbatches)
    if padded == rows:
        return x
    return torch.cat([x, x[-1:].expand(padded - rows, *x.shape[1:])])


class DropPartialBatches:
    """Iterate a loader's first ``length`` batches: drops a last partial batch that micro-batching cannot split."""

    def __init__(self, loader: Any, length: int) -> None:
        self.loader = loader
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[Any]:
        for count, batch in enumerate(self.loader):
            if count >= self._length:
                return
            yield batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def fit_loader(dataloader: object, n_microbatches: int, strategy_name: str) -> object:
    """A training loader whose every batch splits into ``n_microbatches`` equal micro-batches.

    Returns:
        ``dataloader``, or one that drops the last partial batch (with a warning) when its size does not split.

    Raises:
        ValueError: when the batch size itself is not a multiple of ``n_microbatches``.

    """
    batch_size = getattr(dataloader, "batch_size", None)
    if not isinstance(batch_size, int):
        return dataloader
    m = n_microbatches
    if batch_size % m:
        raise ValueError(
            f"The training batch size {batch_size} is not a multiple of n_microbatches={m}: every micro-batch must "
            f"have the same size. Use batch_size={max(m, batch_size - batch_size % m)} or n_microbatches that "
            f"divides {batch_size}."
        )
    try:
        length = len(dataloader)  # type: ignore[arg-type]
        samples = len(dataloader.sampler)  # type: ignore[attr-defined]
    except TypeError:
        return dataloader
    last = samples % batch_size
    if getattr(dataloader, "drop_last", False) or last == 0 or last % m == 0:
        return dataloader
    rank_zero_warn(
        f"{strategy_name}: the last training batch of each epoch has {last} samples, which n_microbatches={m} does "
        f"not divide; it is dropped. Set drop_last=True, or a dataset size per replica that is a multiple of {m}."
    )
    return DropPartialBatches(dataloader, length - 1)
