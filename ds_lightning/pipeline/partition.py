"""Split an ``nn.Sequential`` of ``n`` layers into contiguous stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

__all__ = ["check_balance", "partition_by_cost", "resolve_balance", "stage_layer_ranges"]


def check_balance(balance: object, n_stages: int | None = None) -> list[int] | Literal["auto"] | None:
    """Validate the ``balance`` option of a strategy when it is built, before the layer count is known.

    Args:
        balance: ``None``, ``"auto"`` or a list of layers per stage.
        n_stages: the number of stages when the options already fix it (one per device), else ``None``.

    Returns:
        ``balance``, a list copy for a list.

    Raises:
        ValueError: naming the value and the fix.

    """
    if balance is None or balance == "auto":
        return balance
    example = f"balance={[1] * n_stages}" if n_stages else "balance=[3, 2]"
    if isinstance(balance, str) or not isinstance(balance, Sequence):
        raise ValueError(
            f"balance={balance!r} must be None (equal layer counts), 'auto' (split by measured layer time) or one"
            f" layer count per stage, e.g. {example}."
        )
    entries = list(balance)
    bad = [b for b in entries if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(
            f"balance={entries!r} must hold positive integers (layers per stage), but balance entries={bad[0]!r} is"
            f" not one; use e.g. {example}."
        )
    if n_stages is not None and len(entries) != n_stages:
        raise ValueError(
            f"balance={entries!r} has {len(entries)} entries but devices name {n_stages} stages; give one layer count"
            f" per device, e.g. {example}."
        )
    return entries


def resolve_balance(n_layers: int, n_stages: int, balance: Sequence[int] | None) -> list[int]:
    """Return the number of layers of each stage.

    Args:
        n_layers: layers in the ``nn.Sequential`` to split.
        n_stages: stages to split it into.
        balance: ``None`` for equal shares (the first ``n_layers % n_stages`` stages take one more), or an explicit
            list of layers per stage.

    Raises:
        ValueError: if there are more stages than layers, or ``balance`` has the wrong length, a non-positive entry
            or the wrong sum; the message shows a valid balance.

    """
    if n_stages < 1:
        raise ValueError(f"The pipeline needs at least 1 stage, got {n_stages}.")
    if n_stages > n_layers:
        raise ValueError(
            f"{n_stages} pipeline stages but the pipelined nn.Sequential has only {n_layers} layers: every stage needs "
            f"at least one layer. Use at most {n_layers} stages, or split the model into more layers."
        )
    equal = [n_layers // n_stages + (1 if i < n_layers % n_stages else 0) for i in range(n_stages)]
    if balance is None:
        return equal
    balance = list(balance)
    if len(balance) != n_stages:
        raise ValueError(
            f"balance={balance} has {len(balance)} entries but the pipeline has {n_stages} stages; give one layer "
            f"count per stage, e.g. balance={equal}."
        )
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance={balance} must hold positive integers (layers per stage), e.g. balance={equal}.")
    if sum(balance) != n_layers:
        raise ValueError(
            f"balance={balance} sums to {sum(balance)} but the pipelined nn.Sequential has {n_layers} layers; "
            f"the counts must add up to {n_layers}, e.g. balance={equal}."
        )
    return balance


def stage_layer_ranges(balance: Sequence[int]) -> list[range]:
    """The layer indices of each stage, e.g. ``[2, 3] -> [range(0, 2), range(2, 5)]``."""
    ranges, start = [], 0
    for count in balance:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def partition_by_cost(costs: Sequence[float], n_stages: int) -> list[int]:
    """Split ``costs`` into ``n_stages`` contiguous non-empty parts minimising the largest part's sum.

    Exact dynamic programme over prefix sums, O(n_stages * n^2); ties prefer earlier, smaller stages so the result
    is deterministic on every rank.

    Returns:
        The number of layers of each stage.

    """
    n = len(costs)
    resolve_balance(n, n_stages, None)  # validates n_stages <= n
    if any(c < 0 for c in costs):
        raise ValueError(f"Layer costs must be >= 0, got {list(costs)}.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest achievable max-stage cost putting the first i layers into k stages.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    balance, i = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return balance[::-1]
