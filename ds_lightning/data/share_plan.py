"""Per-rank shares of a fixed global batch, re-divided by measured throughput (pure logic, no processes).

Every rank holds an identical plan and feeds it identical inputs (the all-gathered throughputs), so every rank
computes the same sizes without another collective. A change takes effect ``lag`` batches after it was decided,
on a window boundary, so a data loader that reads ahead never mixes two plans, and every micro-batch of an
accumulation window has the same sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def split_sizes(total: int, weights: Sequence[float], minimum: int) -> list[int]:
    """Divide ``total`` samples in proportion to ``weights``, raising any part below ``minimum`` to it.

    Parts clamped to the minimum are taken out and the rest is divided again in proportion; then largest-remainder
    rounding (ties to the lower rank) makes the parts sum to ``total``.

    Raises:
        ValueError: if ``total`` cannot give every part ``minimum``.

    """
    parts = len(weights)
    if total < minimum * parts:
        raise ValueError(f"{total} samples cannot give {parts} ranks at least {minimum} each.")
    clamped: set[int] = set()
    while True:
        free = [i for i in range(parts) if i not in clamped]
        left = total - minimum * len(clamped)
        weight_sum = float(sum(max(weights[i], 0.0) for i in free))
        exact = {i: left * max(weights[i], 0.0) / weight_sum if weight_sum > 0 else left / len(free) for i in free}
        low = {i for i in free if exact[i] < minimum}
        if not low:
            break
        clamped |= low
    sizes = [minimum if i in clamped else math.floor(exact[i]) for i in range(parts)]
    order = sorted(free, key=lambda i: (sizes[i] - exact[i], i))  # largest remainder first
    for i in order[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


class SharePlan:
    """The sizes each rank takes from every global batch, and how they follow throughput.

    Args:
        global_batch_size: samples per step over all ranks.
        world_size: data-parallel ranks.
        min_share: the smallest fraction of the global batch a rank keeps.
        ema: weight of the newest throughput in the running estimate, in ``(0, 1]``.
        hysteresis: keep the current sizes unless some rank's size would change by more than this fraction of
            its current size.

    """

    def __init__(
        self, global_batch_size: int, world_size: int, min_share: float, ema: float, hysteresis: float
    ) -> None:
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.min_size = max(1, math.ceil(min_share * global_batch_size))
        self.ema = ema
        self.hysteresis = hysteresis
        self.estimate: list[float] | None = None  # samples/s per rank
        even = split_sizes(global_batch_size, [1.0] * world_size, self.min_size)
        self.changes: list[tuple[int, list[int]]] = [(0, even)]  # (first batch it applies to, sizes)

    def sizes_at(self, batch: int) -> list[int]:
        """Every rank's size at global batch index ``batch`` (counted over the whole run)."""
        current = self.changes[0][1]
        for start, sizes in self.changes:
            if start <= batch:
                current = sizes
        return current

    @property
    def latest(self) -> list[int]:
        """The newest sizes, possibly not in force yet."""
        return self.changes[-1][1]

    def observe(self, throughputs: Sequence[float], now: int, lag: int, window: int = 1, origin: int = 0) -> bool:
        """Fold in every rank's newest throughput (samples/s), decided at run-wide batch ``now``.

        Returns:
            Whether new sizes were scheduled: from the first batch at or after ``now + lag`` that lies a whole number
            of ``window`` batches after ``origin`` (the epoch's first batch, where accumulation windows start).

        """
        if self.estimate is None:
            self.estimate = [float(t) for t in throughputs]
        else:
            self.estimate = [
                self.ema * float(t) + (1 - self.ema) * e for t, e in zip(throughputs, self.estimate, strict=True)
            ]
        proposal = split_sizes(self.global_batch_size, self.estimate, self.min_size)
        current = self.latest
        if all(abs(p - c) <= self.hysteresis * c for p, c in zip(proposal, current, strict=True)):
            return False
        start = origin + -(-(now + lag - origin) // window) * window
        self.changes = [(s, sizes) for s, sizes in self.changes if s < start] + [(start, proposal)]
        return True

    def state_dict(self) -> dict[str, Any]:
        """The estimate and the schedule of sizes, as plain numbers."""
        return {"estimate": self.estimate, "changes": [[s, list(sizes)] for s, sizes in self.changes]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (sizes for another world size or batch are ignored)."""
        changes = [(int(s), [int(x) for x in sizes]) for s, sizes in state.get("changes", [])]
        if changes and all(len(sz) == self.world_size and sum(sz) == self.global_batch_size for _, sz in changes):
            self.changes = changes
            estimate = state.get("estimate")
            self.estimate = [float(x) for x in estimate] if estimate else None
