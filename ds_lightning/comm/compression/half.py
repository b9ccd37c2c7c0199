"""What ``fp16`` and ``bf16`` share: gradients all-reduced and pushed at half width (torch's own cast wrappers)."""

# No `from __future__ import annotations`: DDP checks the hooks' annotations at runtime.

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ds_lightning.comm.compression.base import Hook, gradient_numel
from ds_lightning.comm.compression.none import Dense, PlainState, logged_allreduce_hook
from ds_lightning.comm.wire import WireLog

__all__ = ["HalfWidth", "half_width_hook"]


def half_width_hook(wrapper: Callable[[Hook], Hook], name: str) -> Hook:
    """The logged all-reduce inside torch's cast ``wrapper`` (``fp16_compress_wrapper``, ``bf16_compress_wrapper``).

    The wrapper casts the bucket's buffer and hands the cast bucket to the logged all-reduce: the log sees the cast
    tensor. ``name`` is the hook's ``__name__``, which is what DDP and the logs show.
    """
    wrapped = wrapper(logged_allreduce_hook)

    def hook(state: PlainState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return wrapped(state, bucket)

    hook.__name__ = hook.__qualname__ = name
    return hook


class HalfWidth(Dense):
    """A half-width cast of every gradient entry, for the all-reduce, the inter-host stage and pushes.

    Subclasses set ``name``, ``wire_dtype`` and ``hook`` (:func:`half_width_hook` of torch's matching wrapper).
    """

    hook: ClassVar[Hook]

    @override
    def ddp_hook(
        self, process_group: dist.ProcessGroup | None, model: DistributedDataParallel, wire: WireLog, warmup: bool
    ) -> tuple[Any, Hook]:
        return PlainState(process_group, wire), type(self).hook

    @override
    def compute_probe(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> Callable[[], object] | None:
        generator = torch.Generator().manual_seed(0)
        flat = torch.randn(max(gradient_numel(shapes), 1), generator=generator).to(device)
        dtype = self.wire_dtype

        def cast() -> None:  # torch's wrapper: cast the bucket, then copy the reduced halves back
            flat.copy_(flat.to(dtype))

        return cast
