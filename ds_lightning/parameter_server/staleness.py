"""Consistency control for the parameter server: worker clocks, staleness statistics, BSP accumulation.

Pure bookkeeping, no processes: the server loop owns one :class:`StalenessClock` (and, for ``max_staleness=0``, a
:class:`SyncAccumulator`) and calls them as pushes arrive. Everything that is checkpointed or gathered encodes to
tensors, because only tensors cross the wire.

Consistency is set by ``max_staleness``:

* ``None``: fully asynchronous, a worker never waits.
* ``k >= 1``: stale synchronous parallel (SSP). A worker that has finished ``c`` steps may start step ``c + 1`` only
  while ``c - min(clock of live workers) <= k``, so no worker runs more than ``k`` steps ahead of the slowest live one.
* ``0``: bulk synchronous (BSP). The same rule with ``k = 0`` is a barrier: nobody starts step ``c + 1`` before every
  live worker has finished step ``c``, and then all are released together.

Dead and finished workers leave the set of live workers, so they never hold the others back.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "STALENESS_BINS",
    "STALENESS_LR_RULES",
    "StalenessClock",
    "StalenessLRRule",
    "StalenessStats",
    "SyncAccumulator",
    "staleness_lr_factor",
]

StalenessLRRule = Literal["none", "inverse"]
STALENESS_LR_RULES: tuple[str, ...] = get_args(StalenessLRRule)

# Lower edges of the histogram bins: {0}, {1}, [2, 4), [4, 8), [8, 16), [16, inf).
STALENESS_BINS: tuple[int, ...] = (0, 1, 2, 4, 8, 16)

_LIVE, _FINISHED, _DEAD = 0, 1, 2
_STATUS_NAMES = {_LIVE: "live", _FINISHED: "finished", _DEAD: "dead"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_num_workers(num_workers: object) -> int:
    if not _is_int(num_workers) or num_workers < 1:  # type: ignore[operator]
        raise ValueError(f"num_workers={num_workers!r} must be an integer >= 1, e.g. num_workers=2.")
    return num_workers  # type: ignore[return-value]


def _check_worker(worker: object, num_workers: int) -> int:
    if not _is_int(worker) or not 0 <= worker < num_workers:  # type: ignore[operator]
        raise ValueError(f"worker={worker!r} is not a worker index; use an integer in 0..{num_workers - 1}.")
    return worker  # type: ignore[return-value]


def _check_staleness(staleness: object) -> int:
    if not _is_int(staleness) or staleness < 0:  # type: ignore[operator]
        raise ValueError(
            f"staleness={staleness!r} must be an integer >= 0 "
            "(server version when applied minus the version the worker pulled)."
        )
    return staleness  # type: ignore[return-value]


class StalenessClock:
    """Per-worker step clocks and liveness, kept by the server; decides when a worker may start its next step.

    A worker's clock counts the steps it has finished (pushed). Not thread-safe: the server serialises calls.

    Args:
        num_workers: number of workers, >= 1.
        max_staleness: ``None`` (fully asynchronous), ``0`` (bulk synchronous) or ``k >= 1`` (SSP bound).

    Raises:
        ValueError: for ``num_workers < 1`` or a negative / non-integer ``max_staleness``, naming the value and fix.

    """

    def __init__(self, num_workers: int, max_staleness: int | None) -> None:
        self.num_workers = _check_num_workers(num_workers)
        if max_staleness is not None and (not _is_int(max_staleness) or max_staleness < 0):
            raise ValueError(
                f"max_staleness={max_staleness!r} is invalid; use None (fully asynchronous), 0 (bulk synchronous) "
                "or an integer k >= 1 (no worker more than k steps ahead), e.g. max_staleness=2."
            )
        self.max_staleness = max_staleness
        self._clocks = [0] * self.num_workers
        self._status = [_LIVE] * self.num_workers

    def _require_live(self, worker: int, action: str) -> None:
        _check_worker(worker, self.num_workers)
        status = self._status[worker]
        if status != _LIVE:
            raise RuntimeError(
                f"worker {worker} cannot {action}: it was marked {_STATUS_NAMES[status]}; "
                "only live workers step (route its messages nowhere once it is marked)."
            )

    def tick(self, worker: int) -> int:
        """Record that ``worker`` finished a step (its push arrived).

        Returns:
            The worker's new clock (steps finished).

        Raises:
            ValueError: for a worker index out of range.
            RuntimeError: if the worker was marked dead or finished.

        """
        self._require_live(worker, "tick")
        self._clocks[worker] += 1
        return self._clocks[worker]

    def may_start(self, worker: int) -> bool:
        """Whether ``worker`` may start its next step now.

        ``None``: always. Otherwise ``clock[worker] - min(clock of live workers) <= max_staleness``; with ``0`` that
        is a barrier (a worker that finished step ``c`` waits until every live worker finished step ``c``).

        Raises:
            ValueError: for a worker index out of range.
            RuntimeError: if the worker was marked dead or finished.

        """
        self._require_live(worker, "start a step")
        if self.max_staleness is None:
            return True
        return self._clocks[worker] - self.min_clock <= self.max_staleness  # type: ignore[operator]

    def mark_dead(self, worker: int) -> None:
        """Stop waiting for ``worker`` (it died). A finished worker that exits afterwards stays finished."""
        _check_worker(worker, self.num_workers)
        if self._status[worker] == _LIVE:
            self._status[worker] = _DEAD

    def mark_finished(self, worker: int) -> None:
        """Stop waiting for ``worker`` (it completed all its steps).

        Raises:
            RuntimeError: if the worker was already marked dead (a dead worker cannot finish).

        """
        _check_worker(worker, self.num_workers)
        if self._status[worker] == _DEAD:
            raise RuntimeError(f"worker {worker} was marked dead and cannot be marked finished.")
        self._status[worker] = _FINISHED

    @property
    def live_workers(self) -> tuple[int, ...]:
        """Indices of workers neither dead nor finished, ascending."""
        return tuple(w for w, status in enumerate(self._status) if status == _LIVE)

    @property
    def dead_workers(self) -> tuple[int, ...]:
        """Indices of workers marked dead, ascending."""
        return tuple(w for w, status in enumerate(self._status) if status == _DEAD)

    @property
    def finished_workers(self) -> tuple[int, ...]:
        """Indices of workers marked finished, ascending."""
        return tuple(w for w, status in enumerate(self._status) if status == _FINISHED)

    @property
    def clocks(self) -> tuple[int, ...]:
        """Every worker's clock (steps finished), live or not."""
        return tuple(self._clocks)

    @property
    def min_clock(self) -> int | None:
        """Clock of the slowest live worker; ``None`` when no worker is live."""
        live = [self._clocks[w] for w in self.live_workers]
        return min(live) if live else None

    @property
    def slowest(self) -> int | None:
        """Index of the slowest live worker (lowest index on ties); ``None`` when no worker is live."""
        live = self.live_workers
        return min(live, key=lambda w: self._clocks[w]) if live else None

    @property
    def gap(self) -> int:
        """Largest clock difference among live workers (0 with fewer than two)."""
        live = [self._clocks[w] for w in self.live_workers]
        return max(live) - min(live) if live else 0

    def state_dict(self) -> dict[str, Tensor]:
        """Clocks and liveness as int64 tensors (``status``: 0 live, 1 finished, 2 dead)."""
        return {
            "clocks": torch.tensor(self._clocks, dtype=torch.int64),
            "status": torch.tensor(self._status, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict`'s output. ``max_staleness`` stays as constructed.

        Raises:
            ValueError: if the state holds another number of workers or invalid entries.

        """
        clocks = state["clocks"].tolist()
        status = state["status"].tolist()
        if len(clocks) != self.num_workers or len(status) != self.num_workers:
            raise ValueError(
                f"clock state holds {len(clocks)} workers, but this clock has num_workers={self.num_workers}; "
                "resume with the same number of workers."
            )
        if any(c < 0 for c in clocks) or any(s not in _STATUS_NAMES for s in status):
            raise ValueError(f"clock state is corrupt: clocks={clocks}, status={status}.")
        self._clocks = [int(c) for c in clocks]
        self._status = [int(s) for s in status]


class StalenessStats:
    """Staleness of the gradients applied during one logging interval: count, mean, max and a histogram.

    Histogram bins are ``0``, ``1``, ``2-3``, ``4-7``, ``8-15`` and ``16+`` (lower edges :data:`STALENESS_BINS`).
    Encodes to one int64 tensor so that per-server stats can be gathered and merged.
    """

    BIN_LABELS: tuple[str, ...] = ("0", "1", "2-3", "4-7", "8-15", "16+")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new logging interval."""
        self.count = 0
        self.total = 0
        self.max = 0
        self.histogram = [0] * len(STALENESS_BINS)

    @staticmethod
    def bin_index(staleness: int) -> int:
        """Index of the histogram bin holding ``staleness``."""
        _check_staleness(staleness)
        return max(i for i, edge in enumerate(STALENESS_BINS) if staleness >= edge)

    def record(self, staleness: int) -> None:
        """Add one applied gradient's staleness.

        Raises:
            ValueError: for a negative or non-integer staleness.

        """
        index = self.bin_index(staleness)
        self.count += 1
        self.total += staleness
        self.max = max(self.max, staleness)
        self.histogram[index] += 1

    @property
    def mean(self) -> float:
        """Mean staleness over the interval (0.0 when nothing was recorded)."""
        return self.total / self.count if self.count else 0.0

    def merge(self, other: StalenessStats) -> None:
        """Fold ``other``'s interval into this one (e.g. stats of several server shards)."""
        self.count += other.count
        self.total += other.total
        self.max = max(self.max, other.max)
        self.histogram = [a + b for a, b in zip(self.histogram, other.histogram, strict=True)]

    def to_tensor(self) -> Tensor:
        """``[count, total, max, *histogram]`` as one int64 tensor of length ``3 + len(STALENESS_BINS)``."""
        return torch.tensor([self.count, self.total, self.max, *self.histogram], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: Tensor) -> StalenessStats:
        """Inverse of :meth:`to_tensor`.

        Raises:
            ValueError: for a tensor of the wrong shape.

        """
        expected = 3 + len(STALENESS_BINS)
        if tensor.dim() != 1 or tensor.numel() != expected:
            raise ValueError(
                f"StalenessStats tensor has shape {tuple(tensor.shape)}; expected ({expected},) from to_tensor()."
            )
        values = [int(v) for v in tensor.tolist()]
        stats = cls()
        stats.count, stats.total, stats.max = values[:3]
        stats.histogram = values[3:]
        return stats

    def as_dict(self, prefix: str = "staleness") -> dict[str, float]:
        """Scalars for logging: ``{prefix}/mean``, ``{prefix}/max``, ``{prefix}/count`` and one entry per bin."""
        out = {f"{prefix}/mean": self.mean, f"{prefix}/max": float(self.max), f"{prefix}/count": float(self.count)}
        out.update(
            {f"{prefix}/bin_{label}": float(n) for label, n in zip(self.BIN_LABELS, self.histogram, strict=True)}
        )
        return out


def staleness_lr_factor(staleness: int, rule: StalenessLRRule) -> float:
    """Multiplier of the learning rate for a gradient of the given staleness.

    Args:
        staleness: server version when applied minus the version the worker pulled (>= 0).
        rule: ``"none"`` (always 1) or ``"inverse"`` (``1 / max(1, staleness)``).

    Raises:
        ValueError: for an unknown rule or a negative staleness.

    """
    if rule not in STALENESS_LR_RULES:
        raise ValueError(f"staleness_lr={rule!r} is not supported; choose one of {list(STALENESS_LR_RULES)}.")
    _check_staleness(staleness)
    if rule == "none":
        return 1.0
    return 1.0 / max(1, staleness)


class SyncAccumulator:
    """Bulk-synchronous (``max_staleness=0``) gradient collection: one gradient per live worker for one version.

    Workers marked dead are not waited for; a gradient a worker pushed before it was marked dead still counts (it was
    computed on the current version). After applying :meth:`mean`, call :meth:`advance` to collect the next version.

    Args:
        num_workers: number of workers, >= 1.
        version: the parameter version collected first.

    """

    def __init__(self, num_workers: int, version: int = 0) -> None:
        self.num_workers = _check_num_workers(num_workers)
        self.version = version
        self._dead: set[int] = set()
        self._contributors: list[int] = []
        self._sum: Tensor | None = None

    def push(self, worker: int, grad: Tensor, version: int) -> None:
        """Add ``worker``'s gradient computed on parameters of ``version``.

        Raises:
            ValueError: for a worker index out of range, a version other than the one collected, or a gradient whose
                shape/dtype differs from the first one.
            RuntimeError: for a second push from the same worker for this version, or a push from a dead worker.

        """
        _check_worker(worker, self.num_workers)
        if worker in self._dead:
            raise RuntimeError(f"worker {worker} was marked dead; its push for version {version} cannot be accepted.")
        if version != self.version:
            raise ValueError(
                f"worker {worker} pushed a gradient of version {version}, but version {self.version} is being "
                "collected; under max_staleness=0 every worker must pull the newest version before its step."
            )
        if worker in self._contributors:
            raise RuntimeError(
                f"worker {worker} pushed twice for version {version}; bulk synchronous training takes exactly one "
                "gradient per worker per version (wait for may_start before the next step)."
            )
        if self._sum is None:
            self._sum = grad.detach().clone()
        else:
            if grad.shape != self._sum.shape or grad.dtype != self._sum.dtype:
                raise ValueError(
                    f"worker {worker} pushed a gradient of shape {tuple(grad.shape)} and dtype {grad.dtype}; "
                    f"expected shape {tuple(self._sum.shape)} and dtype {self._sum.dtype} like the first push."
                )
            self._sum += grad.detach()
        self._contributors.append(worker)

    def mark_dead(self, worker: int) -> None:
        """Stop waiting for ``worker`` (use for finished workers too)."""
        self._dead.add(_check_worker(worker, self.num_workers))

    @property
    def contributors(self) -> tuple[int, ...]:
        """Workers that pushed for the current version, in arrival order."""
        return tuple(self._contributors)

    @property
    def missing(self) -> tuple[int, ...]:
        """Live workers that have not pushed for the current version yet."""
        return tuple(w for w in range(self.num_workers) if w not in self._dead and w not in self._contributors)

    def ready(self) -> bool:
        """Whether every live worker has pushed for the current version (and at least one gradient arrived)."""
        return bool(self._contributors) and not self.missing

    def mean(self) -> Tensor:
        """Average of the gradients pushed for the current version.

        Raises:
            RuntimeError: if not :meth:`ready`, naming the workers still missing.

        """
        if not self.ready() or self._sum is None:
            raise RuntimeError(
                f"version {self.version} is not complete: waiting for workers {list(self.missing)} "
                f"(received from {list(self._contributors)}); check ready() or mark dead workers with mark_dead()."
            )
        return self._sum / len(self._contributors)

    def advance(self) -> int:
        """Clear the collected gradients and start collecting the next version.

        Returns:
            The new version.

        Raises:
            RuntimeError: if not :meth:`ready` (advancing would drop pushed gradients).

        """
        if not self.ready():
            raise RuntimeError(
                f"advance() before version {self.version} is complete would drop gradients; "
                f"still waiting for workers {list(self.missing)}."
            )
        self.version += 1
        self._contributors = []
        self._sum = None
        return self.version
