"""Where each training step's time goes on this rank: data loading, compute, waiting on communication, optimizer.

One :class:`StepClock` per Trainer (:func:`step_clock`) is shared by every callback that needs step times, so
``DistributedReport`` and ``DynamicLoadBalancer`` read the same measurement instead of timing twice. Callbacks drive
it from their Lightning hooks; each mark is idempotent within a step, so two callbacks calling the same mark record
it once (the first call wins).

The phases of one batch, in the order they happen (times from :func:`time.perf_counter_ns`):

* **data**: from the end of the previous batch (or the start of the epoch, or the end of a validation run) to
  ``on_train_batch_start``: fetching the batch, plus Lightning's own loop bookkeeping.
* **compute**: from ``on_train_batch_start`` to ``on_before_optimizer_step`` (or the batch end when the batch steps
  no optimizer), less the communication wait below: the forward pass, the backward pass and the loss.
* **comm**: for each backward pass, from the moment the last parameter gradient was ready (a
  ``register_post_accumulate_grad_hook`` on every parameter) to ``on_after_backward``. Under DDP the last gradient
  launches the last bucket's all-reduce, and DDP waits for every bucket before the backward pass returns, so this is
  the time this rank waited for the others. Without a gradient synchronisation it is near zero. Also
  communication: Lightning's (2.6 and later) broadcast before each batch, whether a rank got SIGTERM. It is the first
  collective after the all-reduce, so a rank that left the all-reduce early (a ring all-reduce does not end on every
  rank at once) waits there for the others: over a slow link that is tens of milliseconds, which the data phase would
  otherwise carry. :meth:`StepClock.watch_loop` times it.
* **optimizer**: from ``on_before_optimizer_step`` to ``on_train_batch_end``: the optimizer step and anything a
  strategy does there (a ZeRO parameter broadcast, a parameter server push).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PHASES", "StepClock", "StepTime", "step_clock"]

PHASES: tuple[str, ...] = ("data", "compute", "comm", "optimizer")
"""The phases of a step, in the order they happen."""

_ATTRIBUTE = "_ds_step_clock"
_MAX_STEPS = 100_000  # about 10 MB of records; older steps are dropped half at a time beyond this


@dataclass(frozen=True)
class StepTime:
    """One batch on one rank, in nanoseconds.

    Attributes:
        step: index of the batch within the fit, from 0.
        start_ns: :func:`time.time_ns` when the batch started (the end of its data phase), to line ranks up.
        data_ns: data loading before the batch.
        compute_ns: forward and backward, less the communication wait.
        comm_ns: waiting for the gradient synchronisation at the end of backward, and in collectives before the
            batch (``sync_ns``).
        optimizer_ns: the optimizer step.
        sync_ns: the part of ``comm_ns`` spent before the batch, ahead of its data loading (Lightning's broadcast).

    """

    step: int
    start_ns: int
    data_ns: int
    compute_ns: int
    comm_ns: int
    optimizer_ns: int
    sync_ns: int = 0

    @property
    def total_ns(self) -> int:
        """The whole step: data, compute, communication and optimizer."""
        return self.data_ns + self.compute_ns + self.comm_ns + self.optimizer_ns

    @property
    def busy_ns(self) -> int:
        """The step less its communication wait: the time this rank itself needed."""
        return self.total_ns - self.comm_ns

    def phase_ns(self, phase: str) -> int:
        """The time in one of :data:`PHASES`."""
        return int(getattr(self, f"{phase}_ns"))


class StepClock:
    """Marks of the current step and the finished :class:`StepTime` records of this rank (see the module doc)."""

    def __init__(self) -> None:
        self.steps: list[StepTime] = []
        self._wall_offset = time.time_ns() - time.perf_counter_ns()
        self._handles: list[Any] = []
        self._watched: int | None = None
        self._last_end: int | None = None
        self._open = False
        self._start = 0
        self._in_backward = False
        self._backward_start = 0
        self._ready = 0
        self._comm = 0
        self._optimizer_start: int | None = None
        self._count = 0
        self._sync_before = 0  # collective waits in the data phase, counted as communication
        self._sync = 0
        self._loop: Any = None

    # --- set-up ---------------------------------------------------------------------------------------------------

    def watch(self, module: torch.nn.Module) -> None:
        """Hook every trainable parameter of ``module`` to note when its gradient is ready (once per module)."""
        if self._watched == id(module):
            return
        self.unwatch()
        for param in module.parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))
        self._watched = id(module)

    def unwatch(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._watched = [], None

    def watch_loop(self, epoch_loop: Any) -> None:
        """Time Lightning's broadcast before each batch (``_broadcast_sigterm_tensor``) as communication.

        Lightning calls ``torch.distributed.broadcast`` itself there, with no hook around it, so the bound method is
        wrapped on this loop object (a private name, listed in docs/lightning-private-api.md; Lightning before 2.6 has
        no such broadcast, and nothing is wrapped).
        """
        original = getattr(epoch_loop, "_broadcast_sigterm_tensor", None)
        if original is None or self._loop is epoch_loop:
            return
        self.unwatch_loop()

        @functools.wraps(original)
        def timed() -> None:
            begin = time.perf_counter_ns()
            try:
                original()
            finally:
                self.sync_wait(time.perf_counter_ns() - begin)

        epoch_loop._broadcast_sigterm_tensor = timed
        self._loop = epoch_loop

    def unwatch_loop(self) -> None:
        """Put Lightning's own broadcast back."""
        if self._loop is not None:
            vars(self._loop).pop("_broadcast_sigterm_tensor", None)
            self._loop = None

    def sync_wait(self, nanoseconds: int) -> None:
        """A collective before the batch took ``nanoseconds``: communication, not data loading."""
        if not self._open:
            self._sync_before += nanoseconds

    def reset(self) -> None:
        """Forget the recorded steps (a new fit starts)."""
        self.steps, self._count, self._last_end, self._open, self._in_backward = [], 0, None, False, False

    def _grad_ready(self, _param: torch.Tensor) -> None:
        self._ready = time.perf_counter_ns()

    # --- marks, driven by Lightning hooks -------------------------------------------------------------------------

    def pause(self) -> None:
        """A data phase starts now: the epoch starts, or validation ended (``on_train_epoch_start``...)."""
        if not self._open:
            self._last_end, self._sync_before = time.perf_counter_ns(), 0

    def batch_start(self) -> None:
        """``on_train_batch_start``."""
        if self._open:
            return
        self._open, self._start = True, time.perf_counter_ns()
        self._comm, self._optimizer_start, self._in_backward = 0, None, False
        self._sync, self._sync_before = self._sync_before, 0

    def backward_start(self) -> None:
        """``on_before_backward``."""
        if self._open and not self._in_backward:
            self._in_backward, self._backward_start, self._ready = True, time.perf_counter_ns(), 0

    def backward_end(self) -> None:
        """``on_after_backward``: the wait since the last gradient was ready is communication."""
        if not self._in_backward:
            return
        self._in_backward = False
        end = time.perf_counter_ns()
        if self._backward_start <= self._ready <= end:
            self._comm += end - self._ready

    def optimizer_start(self) -> None:
        """``on_before_optimizer_step``."""
        if self._open and self._optimizer_start is None:
            self._optimizer_start = time.perf_counter_ns()

    def batch_end(self) -> StepTime | None:
        """``on_train_batch_end``: close the step and return it (``None`` if it was already closed)."""
        if not self._open:
            return None
        end = time.perf_counter_ns()
        self._open, self._in_backward = False, False
        data = self._start - self._last_end - self._sync if self._last_end is not None else 0
        work_end = self._optimizer_start if self._optimizer_start is not None else end
        compute = max(0, work_end - self._start - self._comm)
        record = StepTime(
            step=self._count,
            start_ns=self._start + self._wall_offset,
            data_ns=max(0, data),
            compute_ns=compute,
            comm_ns=self._comm + self._sync,
            optimizer_ns=end - work_end,
            sync_ns=self._sync,
        )
        self.steps.append(record)
        if len(self.steps) > _MAX_STEPS:
            del self.steps[: _MAX_STEPS // 2]
        self._count += 1
        self._last_end = end
        return record

    @property
    def last(self) -> StepTime | None:
        """The most recent finished step."""
        return self.steps[-1] if self.steps else None

    def wall_ns(self, perf_ns: int) -> int:
        """A :func:`time.perf_counter_ns` reading as :func:`time.time_ns`."""
        return perf_ns + self._wall_offset

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={len(self.steps)}, watched_parameters={len(self._handles)})"


def step_clock(trainer: Any) -> StepClock:
    """The :class:`StepClock` shared by every callback of ``trainer`` (created on first use)."""
    clock = getattr(trainer, _ATTRIBUTE, None)
    if not isinstance(clock, StepClock):
        clock = StepClock()
        setattr(trainer, _ATTRIBUTE, clock)
    return clock
