"""The GPipe fill-drain schedule as a pure function: which (micro-batch, stage) tasks run at each clock tick."""

from __future__ import annotations

from ds_lightning import _validation as check

__all__ = ["clock_cycles"]

_EXAMPLE = "clock_cycles(n_microbatches=4, n_stages=2)"


def clock_cycles(n_microbatches: int, n_stages: int) -> list[list[tuple[int, int]]]:
    """The forward tasks of a GPipe pipeline, grouped by clock tick (torchgpipe's ``clock_cycles``).

    At tick ``k`` every task ``(i, j)`` with ``i + j == k`` may run: micro-batch ``i`` on stage ``j``. Within a tick
    the tasks are ordered by stage ``j`` ascending. Tasks of one tick use different stages, so on separate devices
    they can run at the same time; task ``(i, j)`` always comes one tick after ``(i, j - 1)``, whose output it consumes.
    There are ``n_microbatches + n_stages - 1`` ticks and every task appears exactly once.

    Example:
        Three micro-batches through two stages::

            >>> clock_cycles(3, 2)
            [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]

    Args:
        n_microbatches: number of micro-batches ``m``.
        n_stages: number of pipeline stages ``n``.

    Returns:
        One list of ``(micro_batch, stage)`` tasks per clock tick.

    Raises:
        ValueError: if either count is not an integer >= 1.

    """
    check.integer("n_microbatches", n_microbatches, 1, _EXAMPLE)
    check.integer("n_stages", n_stages, 1, _EXAMPLE)
    m, n = n_microbatches, n_stages
    return [[(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))] for k in range(m + n - 1)]
