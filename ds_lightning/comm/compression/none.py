"""``gradient_compression="none"``: gradients travel at full width (DDP's own all-reduce when nothing wraps it)."""

# No `from __future__ import annotations`: DDP checks the hooks' annotations at runtime.

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ds_lightning.comm.compression.base import Compression, Hook
from ds_lightning.comm.compression.registry import register
from ds_lightning.comm.wire import WireLog

__all__ = [
    "NO_COMPRESSION",
    "Dense",
    "NoCompression",
    "PlainState",
    "check_flat",
    "check_payload",
    "logged_allreduce_hook",
]

NO_COMPRESSION = "none"


@dataclass
class PlainState:
    """State of the plain and half-width hooks: the group plus what was sent."""

    process_group: dist.ProcessGroup | None
    wire: WireLog = field(default_factory=WireLog)


def logged_allreduce_hook(state: PlainState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Torch's all-reduce hook, logging the very tensor it all-reduces (the cast wrappers hand it the cast one)."""
    state.wire.record(bucket.buffer())
    if bucket.is_last():
        state.wire.end_step()
    return default_hooks.allreduce_hook(state.process_group, bucket)  # type: ignore[arg-type]


def _allreduce_hook(state: PlainState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return logged_allreduce_hook(state, bucket)


def check_flat(flat_grad: Tensor) -> None:
    """Refuse a push gradient that is not 1-D.

    Raises:
        ValueError: naming the shape and the fix.

    """
    if flat_grad.dim() != 1:
        raise ValueError(
            f"encode expects a flat 1-D gradient, got shape {tuple(flat_grad.shape)}; pass grad.reshape(-1)."
        )


def check_payload(name: str, payload: Sequence[Tensor], expected: int) -> None:
    """Refuse a payload of the wrong length for method ``name``.

    Raises:
        ValueError: naming both lengths and the fix.

    """
    if len(payload) != expected:
        raise ValueError(
            f"a {name!r} payload holds {expected} tensor(s), got {len(payload)}; decode with the sender's"
            " gradient_compression."
        )


class Dense(Compression):
    """A method that sends every entry, at :attr:`wire_dtype`: its push is the flat gradient, cast."""

    uses = frozenset({"all_reduce", "two_level", "push"})

    @override
    def encode(self, flat_grad: Tensor) -> list[Tensor]:
        check_flat(flat_grad)
        return [flat_grad.to(self.wire_dtype) if self.wire_dtype is not None else flat_grad]

    @override
    def decode(self, payload: Sequence[Tensor], numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        check_payload(self.name, payload, 1)
        (dense,) = payload
        if dense.shape != (numel,):
            raise ValueError(f"{self.name!r} payload has shape {tuple(dense.shape)}; expected ({numel},).")
        return dense.to(dtype)

    @override
    def payload_shapes(
        self, numel: int, dtype: torch.dtype = torch.float32
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((numel,), self.wire_dtype or dtype)]


@register
class NoCompression(Dense):
    """Full-width gradients: DDP's all-reduce, the plain inter-host all-reduce, the flat gradient as the push."""

    name = NO_COMPRESSION
    builtin = True
    lossless = True
    auto_candidate = True

    @override
    def ddp_hook(
        self, process_group: dist.ProcessGroup | None, model: DistributedDataParallel, wire: WireLog, warmup: bool
    ) -> tuple[Any, Hook]:
        return PlainState(process_group, wire), _allreduce_hook
