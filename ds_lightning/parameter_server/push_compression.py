"""Compression of the gradients workers push to parameter servers; every payload is a list of tensors.

* ``none``: the flat gradient itself.
* ``fp16`` / ``bf16``: the gradient cast to half width.
* ``topk``: int64 indices and values of the ``k = ceil(topk_ratio * numel)`` largest-magnitude entries. With error
  feedback, what was not sent is kept as a residual and added to the next gradient, so over many pushes the sum of
  what the server received equals the sum of the true gradients minus the current residual.

Decoding needs no residual, so servers decode with a compressor of the same settings. :meth:`PushCompressor.
payload_shapes` tells a receiver the shapes and dtypes to pre-allocate for point-to-point ``recv``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = ["PUSH_COMPRESSIONS", "PushCompressionName", "PushCompressor", "topk_count"]

PushCompressionName = Literal["none", "fp16", "bf16", "topk"]
PUSH_COMPRESSIONS: tuple[str, ...] = get_args(PushCompressionName)

_CAST_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _check_name(name: object) -> str:
    if name not in PUSH_COMPRESSIONS:
        raise ValueError(f"push_compression={name!r} is not supported; choose one of {list(PUSH_COMPRESSIONS)}.")
    return name  # type: ignore[return-value]


def _check_ratio(topk_ratio: object) -> float:
    if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float)) or not 0 < topk_ratio <= 1:
        raise ValueError(f"topk_ratio={topk_ratio!r} must be a number in (0, 1], e.g. topk_ratio=0.01.")
    return float(topk_ratio)


def topk_count(numel: int, topk_ratio: float) -> int:
    """Entries a top-k push of ``numel`` values sends: ``ceil(topk_ratio * numel)``, at least 1 (0 when empty).

    The product is rounded to 6 decimals first so that, e.g., ``0.07 * 100`` gives 7 and not 8 on both sides.
    """
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(round(topk_ratio * numel, 6))))


class PushCompressor:
    """One worker's (or server's) push compression setting, with the top-k error-feedback residual.

    Args:
        name: ``"none"``, ``"fp16"``, ``"bf16"`` or ``"topk"``.
        topk_ratio: fraction of entries ``"topk"`` sends, in ``(0, 1]``.
        error_feedback: keep what ``"topk"`` did not send and add it to the next gradient.

    Raises:
        ValueError: for an unknown ``name`` or out-of-range ``topk_ratio``, naming the value and the fix.

    """

    def __init__(
        self, name: PushCompressionName = "none", topk_ratio: float = 0.01, error_feedback: bool = True
    ) -> None:
        self.name = _check_name(name)
        self.topk_ratio = _check_ratio(topk_ratio)
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback={error_feedback!r} must be True or False.")
        self.error_feedback = error_feedback
        self._residual: Tensor | None = None

    @property
    def residual(self) -> Tensor | None:
        """What top-k has not sent yet (``None`` before the first push or without error feedback)."""
        return self._residual

    def reset(self) -> None:
        """Drop the residual."""
        self._residual = None

    def encode(self, flat_grad: Tensor) -> list[Tensor]:
        """Compress a flat gradient into the tensors to send.

        Args:
            flat_grad: 1-D gradient (``torch.cat([g.reshape(-1) for g in grads])``).

        Returns:
            ``[grad]`` (the same tensor) for ``none``; ``[grad.to(half)]`` for ``fp16``/``bf16``; ``[indices (int64,
            ascending), values (grad's dtype)]`` for ``topk``.

        Raises:
            ValueError: for a tensor that is not 1-D, or whose size differs from the residual's.

        """
        if flat_grad.dim() != 1:
            raise ValueError(
                f"encode expects a flat 1-D gradient, got shape {tuple(flat_grad.shape)}; pass grad.reshape(-1)."
            )
        if self.name == "none":
            return [flat_grad]
        if self.name in _CAST_DTYPES:
            return [flat_grad.to(_CAST_DTYPES[self.name])]
        acc = flat_grad.detach()
        if self.error_feedback and self._residual is not None:
            if self._residual.numel() != acc.numel():
                raise ValueError(
                    f"gradient has {acc.numel()} entries but the top-k residual has {self._residual.numel()}; "
                    "use one PushCompressor per parameter set, or call reset() after changing the model."
                )
            acc = acc + self._residual.to(device=acc.device, dtype=acc.dtype)
        k = topk_count(acc.numel(), self.topk_ratio)
        indices = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
        values = acc[indices]
        if self.error_feedback:
            residual = acc.clone()
            residual[indices] = 0
            self._residual = residual
        return [indices, values]

    def decode(self, payload: Sequence[Tensor], numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rebuild the dense flat gradient from a payload (no residual needed).

        Args:
            payload: what :meth:`encode` returned (or the buffers it was received into).
            numel: length of the flat gradient.
            dtype: dtype of the result. For ``none`` the payload tensor itself is returned when it already has it.

        Raises:
            ValueError: for a payload whose length, shapes or indices do not fit ``name`` and ``numel``.

        """
        expected = 2 if self.name == "topk" else 1
        if len(payload) != expected:
            raise ValueError(
                f"a {self.name!r} payload holds {expected} tensor(s), got {len(payload)}; "
                "decode with a PushCompressor of the sender's settings."
            )
        if self.name != "topk":
            (dense,) = payload
            if dense.shape != (numel,):
                raise ValueError(f"{self.name!r} payload has shape {tuple(dense.shape)}; expected ({numel},).")
            return dense.to(dtype)
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

    @staticmethod
    def payload_bytes(payload: Sequence[Tensor]) -> int:
        """Bytes the payload's tensors occupy on the wire."""
        return sum(t.numel() * t.element_size() for t in payload)

    def state_dict(self) -> dict[str, Tensor]:
        """The top-k residual, as ``{"residual": tensor}`` (empty when there is none)."""
        residual = self._residual if self._residual is not None else torch.empty(0)
        return {"residual": residual.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: for a non-empty residual on a compressor that keeps none (not ``topk`` with error feedback).

        """
        residual = state["residual"]
        if residual.numel() == 0:
            self._residual = None
            return
        if self.name != "topk" or not self.error_feedback:
            raise ValueError(
                f"the state holds a residual of {residual.numel()} entries, but push_compression={self.name!r} "
                f"with error_feedback={self.error_feedback} keeps none; resume with name='topk', error_feedback=True."
            )
        self._residual = residual.detach().clone().reshape(-1)

    @staticmethod
    def payload_shapes(
        name: PushCompressionName, numel: int, topk_ratio: float = 0.01, dtype: torch.dtype = torch.float32
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the tensors :meth:`encode` sends, for pre-allocating ``recv`` buffers.

        Args:
            name: the compression name.
            numel: length of the flat gradient.
            topk_ratio: the sender's ``topk_ratio`` (only for ``"topk"``).
            dtype: the gradient's dtype (for ``"none"`` and the top-k values).

        """
        _check_name(name)
        if name == "topk":
            k = topk_count(numel, _check_ratio(topk_ratio))
            return [((k,), torch.int64), ((k,), dtype)]
        return [((numel,), _CAST_DTYPES.get(name, dtype))]
