"""Micro-batching, one engine for ``ds_pipeline`` and ``ds_model_parallel``.

A batch is cut along dim 0 with ``torch.tensor_split`` (as torch's pipeline schedules cut it); here live the rules
around that: how many micro-batches a batch gets, running them through local stages in GPipe clock order, padding an
evaluation batch, refusing or trimming training batches that do not split evenly, and the ``nn.Sequential`` that
``ds_model_parallel`` puts in place of the user's to run its stages on local devices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from ds_lightning.pipeline.clock import clock_cycles
from ds_lightning.pipeline.partition import stage_layer_ranges

__all__ = [
    "DropPartialBatches",
    "MicroBatchedSequential",
    "check_divisible",
    "fit_loader",
    "pad_inputs",
    "run_clocked",
    "scatter",
]


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


def pad_inputs(inputs: Sequence[Any], kwargs: Mapping[str, Any], rows: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Every batched tensor among ``inputs`` and ``kwargs`` with its last row repeated up to ``rows`` rows."""

    def pad(value: Any) -> Any:
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] >= rows:
            return value
        return torch.cat([value, value[-1:].expand(rows - value.shape[0], *value.shape[1:])])

    return tuple(pad(v) for v in inputs), {k: pad(v) for k, v in kwargs.items()}


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


class MicroBatchedSequential(nn.Sequential):
    """The user's layers, unchanged and under their original names, run stage by stage on GPipe micro-batches.

    The layers are the same objects as in the user's ``nn.Sequential``, so ``state_dict()`` keys do not change. Each
    stage's layers live on that stage's device; ``forward`` moves activations between devices and returns the output
    on the first device. Autograd runs the backward pass across the devices.
    """

    def __init__(
        self,
        original: nn.Sequential,
        balance: Sequence[int],
        devices: Sequence[torch.device],
        n_microbatches: int,
        activation_checkpointing: bool,
    ) -> None:
        super().__init__(OrderedDict(original._modules.items()))
        self.training = original.training
        layers = list(original._modules.values())
        # Plain lists (not registered submodules), so the layers keep their one name each in the state_dict.
        self._stages: list[list[nn.Module]] = [[layers[i] for i in r] for r in stage_layer_ranges(balance)]
        self._devices = list(devices)
        self._balance = list(balance)
        self.n_microbatches = n_microbatches
        self.activation_checkpointing = activation_checkpointing

    def _run_stage(self, stage: int, x: Tensor) -> Tensor:
        for layer in self._stages[stage]:
            x = layer(x)
        if not isinstance(x, Tensor):
            raise TypeError(
                f"ds_model_parallel: stage {stage} returned {type(x).__name__}; every layer of the split nn.Sequential"
                " must take and return a single tensor."
            )
        return x

    @override
    def forward(self, x: Tensor) -> Tensor:
        """Split ``x`` into micro-batches along dim 0, run them through the stages in clock order, concatenate."""
        if not isinstance(x, Tensor) or x.dim() == 0:
            raise TypeError(
                f"ds_model_parallel splits its input along dim 0 into micro-batches, so it needs a tensor with a"
                f" batch dimension; got {type(x).__name__ if not isinstance(x, Tensor) else 'a 0-dim tensor'}."
            )
        stages = [partial(self._run_stage, j) for j in range(len(self._stages))]
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        return run_clocked(stages, self._devices, x, self.n_microbatches, recompute)

    @override
    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            # nn.Sequential would call our constructor with one OrderedDict; a slice is an ordinary Sequential.
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    @override
    def extra_repr(self) -> str:
        devices = [str(d) for d in self._devices]
        return f"balance={self._balance}, devices={devices}, n_microbatches={self.n_microbatches}"
