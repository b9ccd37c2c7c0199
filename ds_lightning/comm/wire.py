"""What this rank's gradient comm hooks really hand to collectives: bytes and dtypes, counted per step.

Each hook records the exact tensor it passes to ``dist.all_reduce``, so the figure shows what compression achieved
(and that the chosen hook ran at all) rather than what a parameter count predicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["WireLog"]


@dataclass
class WireLog:
    """Payload counters of one rank's gradient collectives.

    Attributes:
        bytes_sent: bytes of every tensor handed to a collective, over all closed and open steps.
        steps: gradient synchronisations closed by :meth:`end_step` (one per optimizer step).
        last_step_bytes: bytes of the last closed step (compression's steady state, past any warm-up).
        dtypes: names of the dtypes sent, e.g. ``{"torch.bfloat16"}``.

    """

    bytes_sent: int = 0
    steps: int = 0
    last_step_bytes: int = 0
    dtypes: set[str] = field(default_factory=set)
    _open_step_bytes: int = 0

    def record(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as sent; call it with the very tensor handed to the collective."""
        size = tensor.numel() * tensor.element_size()
        self.bytes_sent += size
        self._open_step_bytes += size
        self.dtypes.add(str(tensor.dtype))

    def end_step(self) -> None:
        """Close the current step (at its last bucket)."""
        self.steps += 1
        self.last_step_bytes = self._open_step_bytes
        self._open_step_bytes = 0

    @property
    def bytes_per_step(self) -> float:
        """Mean bytes per closed step (0.0 before the first)."""
        return (self.bytes_sent - self._open_step_bytes) / self.steps if self.steps else 0.0
