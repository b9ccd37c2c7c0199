"""``gradient_compression="topk"`` (parameter-server pushes only): the largest entries, with error feedback.

A push sends int64 indices and values of the ``k = ceil(topk_ratio * numel)`` largest-magnitude entries. With error
feedback, what was not sent is kept as a residual and added to the next gradient, so over many pushes the sum of what
the server received equals the sum of the true gradients minus the current residual. Decoding needs no residual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from ds_lightning.comm.compression.base import Compression
from ds_lightning.comm.compression.none import check_flat, check_payload
from ds_lightning.comm.compression.registry import register

__all__ = ["TopK", "topk_count"]


def topk_count(numel: int, topk_ratio: float) -> int:
    """Entries a top-k push of ``numel`` values sends: ``ceil(topk_ratio * numel)``, at least 1 (0 when empty).

    The product is rounded to 6 decimals first so that, e.g., ``0.07 * 100`` gives 7 and not 8 on both sides.
    """
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(round(topk_ratio * numel, 6))))


@register
class TopK(Compression):
    """Sparse pushes of the largest entries; ``topk_ratio`` sets the share, ``error_feedback`` keeps the rest."""

    name = "topk"
    uses = frozenset({"push"})
    unsupported = {
        "all_reduce": "each rank would send other indices, which an all-reduce cannot sum",
        "two_level": "each host would send other indices, which an all-reduce cannot sum",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._residual: Tensor | None = None

    @override
    @property
    def residual(self) -> Tensor | None:
        return self._residual

    @override
    def reset(self) -> None:
        self._residual = None

    @override
    def encode(self, flat_grad: Tensor) -> list[Tensor]:
        """``[indices (int64, ascending), values (the gradient's dtype)]``."""
        check_flat(flat_grad)
        acc = flat_grad.detach()
        feedback = self.options.error_feedback
        if feedback and self._residual is not None:
            if self._residual.numel() != acc.numel():
                raise ValueError(
                    f"gradient has {acc.numel()} entries but the top-k residual has {self._residual.numel()}; "
                    "use one compressor per parameter set, or call reset() after changing the model."
                )
            acc = acc + self._residual.to(device=acc.device, dtype=acc.dtype)
        k = topk_count(acc.numel(), self.options.topk_ratio)
        indices = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
        values = acc[indices]
        if feedback:
            residual = acc.clone()
            residual[indices] = 0
            self._residual = residual
        return [indices, values]

    @override
    def decode(self, payload: Sequence[Tensor], numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        check_payload(self.name, payload, 2)
        indices, values = payload
        if indices.dtype != torch.int64 or indices.dim() != 1 or indices.shape != values.shape:
            raise ValueError(
                f"top-k payload needs 1-D int64 indices and values of the same length; got indices "
                f"{tuple(indices.shape)} {indices.dtype} and values {tuple(values.shape)} {values.dtype}."
            )
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise ValueError(
                f"top-k indices span {int(indices.min())}..{int(indices.max())}, outside a gradient of numel={numel}."
            )
        dense = torch.zeros(numel, dtype=dtype, device=values.device)
        dense[indices] = values.to(dtype)
        return dense

    @override
    def payload_shapes(
        self, numel: int, dtype: torch.dtype = torch.float32
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        k = topk_count(numel, self.options.topk_ratio)
        return [((k,), torch.int64), ((k,), dtype)]

    @override
    def state_dict(self) -> dict[str, Any]:
        """The residual (empty when there is none)."""
        residual = self._residual if self._residual is not None else torch.empty(0)
        return {"residual": residual.clone()}

    @override
    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        residual = state["residual"]
        if residual.numel() == 0:
            self._residual = None
            return
        if not self.options.error_feedback:
            raise ValueError(
                f"the state holds a residual of {residual.numel()} entries, but gradient_compression={self.name!r}"
                " with error_feedback=False keeps none; resume with error_feedback=True."
            )
        restored = residual.detach().clone().reshape(-1)
        self._residual = restored.to(device) if device is not None else restored
