"""The ``"auto"`` planner: a pure function from unit sizes and per-device free bytes to a device slot per unit.

Units keep their order (the model's registration order, which is its forward order for the models we know), and each
device takes a contiguous run of them, so a forward pass crosses each device boundary once or a few times rather than
at every unit. Two modes:

* ``balanced=True`` (what ``"auto"`` uses): minimise the largest ``load / free`` over the devices, exactly, by dynamic
  programming over the split points. Devices with more free memory take proportionally more bytes.
* ``balanced=False``: fill the first device until the next unit does not fit, then the next, as accelerate's
  ``infer_auto_device_map`` does. Kept as the control that shows what balancing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

__all__ = ["plan"]


def _fail(sizes: Sequence[int], free: Sequence[int], base: Sequence[int]) -> ValueError:
    return ValueError(
        f"device_map='auto' cannot place {sum(sizes) + sum(base)} bytes of parameters and buffers (units of"
        f" {list(sizes)} bytes, {list(base)} fixed per device) on devices with {list(free)} free bytes: a device would"
        " overflow. Add devices, free memory on them, shrink the model, or write an explicit device_map."
    )


def _sequential(sizes: Sequence[int], free: Sequence[int], base: Sequence[int]) -> list[int]:
    slots, slot, load = [], 0, base[0]
    for size in sizes:
        while load + size > free[slot]:
            slot += 1
            if slot == len(free):
                raise _fail(sizes, free, base)
            load = base[slot]
        slots.append(slot)
        load += size
    return slots


def _balanced(sizes: Sequence[int], free: Sequence[int], base: Sequence[int]) -> list[int]:
    n, k = len(sizes), len(free)
    prefix = [0, *accumulate(sizes)]
    inf = float("inf")

    def cost(device: int, start: int, stop: int) -> float:
        load = base[device] + prefix[stop] - prefix[start]
        if load > free[device]:
            return inf
        return load / free[device] if free[device] > 0 else (0.0 if load == 0 else inf)

    # best[d][i]: the smallest worst ratio placing units [0, i) on devices [0, d]; cut[d][i]: where device d starts.
    best = [[inf] * (n + 1) for _ in range(k)]
    cut = [[0] * (n + 1) for _ in range(k)]
    for i in range(n + 1):
        best[0][i] = cost(0, 0, i)
    for d in range(1, k):
        for i in range(n + 1):
            for j in range(i + 1):  # device d takes units [j, i); on a tie the earliest start wins
                value = max(best[d - 1][j], cost(d, j, i))
                if value < best[d][i]:
                    best[d][i], cut[d][i] = value, j
    if best[k - 1][n] == inf:
        raise _fail(sizes, free, base)
    slots, stop = [0] * n, n
    for d in range(k - 1, 0, -1):
        start = cut[d][stop]
        slots[start:stop] = [d] * (stop - start)
        stop = start
    return slots


def plan(
    sizes: Sequence[int], free: Sequence[int], *, base: Sequence[int] | None = None, balanced: bool = True
) -> list[int]:
    """The device slot (an index into ``free``) of each unit, non-decreasing in unit order.

    Args:
        sizes: bytes of each unit, in the order the units are placed.
        free: free bytes of each device slot.
        base: bytes already on each slot before the units (e.g. the root module's own parameters on slot 0).
        balanced: minimise the largest ``load / free``; ``False`` fills the slots one after another.

    Returns:
        One slot per unit.

    Raises:
        ValueError: when the units do not fit, naming the sizes and the free bytes.

    """
    if not free:
        raise ValueError("device_map='auto' needs at least one device; pass devices=['cuda:0', 'cuda:1'].")
    if any(s < 0 for s in sizes) or any(f < 0 for f in free):
        raise ValueError(f"sizes {list(sizes)} and free bytes {list(free)} must be >= 0.")
    fixed = list(base) if base is not None else [0] * len(free)
    if len(fixed) != len(free):
        raise ValueError(f"base has {len(fixed)} entries for {len(free)} devices; give one per device.")
    if not sizes:
        return []
    return _balanced(sizes, free, fixed) if balanced else _sequential(sizes, free, fixed)
