"""Preemption signals: note them in the handler, act on them at a step boundary the ranks agree on.

A signal handler only sets a flag (checkpointing inside a handler is what made Lightning's SLURM requeue fragile:
the handler can run in the middle of a collective). A grace timer bounds the wait: if the run has not exited
``grace_seconds`` after the signal, the process exits with ``exit_code`` and the previous backup stands.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

__all__ = ["PreemptionWatch"]

log = logging.getLogger(__name__)


class PreemptionWatch:
    """Catch ``signals``, remember the first, and enforce a deadline for the exit that must follow.

    Args:
        signals: the signals a scheduler sends before it stops a job (SIGTERM from Kubernetes and SLURM, SIGUSR1
            from SLURM's ``--signal``).
        grace_seconds: how long after the signal the process may still run.
        exit_code: the code the process exits with (SLURM requeues on a code chosen by the job script).

    """

    def __init__(self, signals: Sequence[signal.Signals], grace_seconds: float, exit_code: int) -> None:
        self.signals = tuple(signals)
        self.grace_seconds = grace_seconds
        self.exit_code = exit_code
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._timer: threading.Timer | None = None

    @property
    def installed(self) -> bool:
        """Whether the handlers are in place."""
        return bool(self._previous)

    def install(self) -> None:
        """Install the handlers (main thread only; elsewhere signals cannot be caught and this does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Put the previous handlers back and cancel the deadline."""
        for sig, previous in self._previous.items():
            if threading.current_thread() is threading.main_thread():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.cancel_deadline()

    def cancel_deadline(self) -> None:
        """Stop the grace timer (the run exits by itself)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received = signal.Signals(signum)
        self._timer = threading.Timer(self.grace_seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        log.error(
            "BackupAndRestore: no backup within grace_seconds=%s of %s; exiting with code %d, the previous backup"
            " stands.",
            self.grace_seconds,
            self.received.name if self.received else "the signal",
            self.exit_code,
        )
        os._exit(self.exit_code)
