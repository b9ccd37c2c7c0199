"""Compression of the gradients workers push to parameter servers: a registered method that serves ``"push"``.

Every payload is a list of tensors. The methods (``none``, ``fp16``, ``bf16``, ``topk``, and any registered later)
live in :mod:`ds_lightning.comm.compression`; a :class:`PushCompressor` is one sender's (or receiver's) instance, with
its own top-k residual. Decoding needs no residual, so servers decode with a compressor of the sender's name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ds_lightning.comm.compression import CompressionOptions, create, names
from ds_lightning.comm.compression.topk import topk_count

__all__ = ["PushCompressor", "push_compressions", "topk_count"]


def push_compressions() -> tuple[str, ...]:
    """The registered methods that compress pushes."""
    return names("push")


class PushCompressor:
    """One worker's (or server's) push compression setting, with the method's state (top-k's residual).

    Args:
        name: a registered method that serves pushes: ``"none"``, ``"fp16"``, ``"bf16"`` or ``"topk"``.
        topk_ratio: fraction of entries ``"topk"`` sends, in ``(0, 1]``.
        error_feedback: keep what ``"topk"`` did not send and add it to the next gradient.

    Raises:
        ValueError: for an unknown ``name``, one that does not compress pushes, or an out-of-range option, naming the
            value and the fix.

    """

    def __init__(self, name: str = "none", topk_ratio: float = 0.01, error_feedback: bool = True) -> None:
        self.method = create(name, CompressionOptions(topk_ratio=topk_ratio, error_feedback=error_feedback), "push")
        self.name = name
        self.topk_ratio = float(topk_ratio)
        self.error_feedback = error_feedback

    @property
    def residual(self) -> Tensor | None:
        """What has not been sent yet (``None`` before the first push, or for a method that keeps nothing)."""
        return self.method.residual

    def reset(self) -> None:
        """Drop the residual."""
        self.method.reset()

    def encode(self, flat_grad: Tensor) -> list[Tensor]:
        """Compress a flat 1-D gradient (``torch.cat([g.reshape(-1) for g in grads])``) into the tensors to send.

        Raises:
            ValueError: for a tensor that is not 1-D, or whose size differs from the residual's.

        """
        return self.method.encode(flat_grad)

    def decode(self, payload: Sequence[Tensor], numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rebuild the dense flat gradient of ``numel`` entries and ``dtype`` from a payload (no residual needed).

        Raises:
            ValueError: for a payload whose length, shapes or indices do not fit the method and ``numel``.

        """
        return self.method.decode(payload, numel, dtype)

    @staticmethod
    def payload_bytes(payload: Sequence[Tensor]) -> int:
        """Bytes the payload's tensors occupy on the wire."""
        return sum(t.numel() * t.element_size() for t in payload)

    def state_dict(self) -> dict[str, Tensor]:
        """The residual, as ``{"residual": tensor}`` (empty when there is none)."""
        residual = self.residual
        return {"residual": residual.clone() if residual is not None else torch.empty(0)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: for a non-empty residual on a compressor that keeps none.

        """
        residual = state["residual"]
        if residual.numel() and not self.method.state_dict():
            raise ValueError(
                f"the state holds a residual of {residual.numel()} entries, but gradient_compression={self.name!r}"
                f" with error_feedback={self.error_feedback} keeps none; resume with gradient_compression='topk',"
                " error_feedback=True."
            )
        self.method.load_state_dict({"residual": residual})

    @staticmethod
    def payload_shapes(
        name: str, numel: int, topk_ratio: float = 0.01, dtype: torch.dtype = torch.float32
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the tensors :meth:`encode` sends, for pre-allocating ``recv`` buffers.

        Args:
            name: the method's name.
            numel: length of the flat gradient.
            topk_ratio: the sender's ``topk_ratio`` (only for ``"topk"``).
            dtype: the gradient's dtype (for ``"none"`` and the top-k values).

        """
        return create(name, CompressionOptions(topk_ratio=topk_ratio), "push").payload_shapes(numel, dtype)
