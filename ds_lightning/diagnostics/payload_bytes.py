"""Payload bytes each rank handed to and got from collectives, counted at the process group by torch's Flight Recorder.

Gloo keeps no byte counter (``memory_stats``, completion hooks and ``Work`` durations are NCCL-only), but torch's
Flight Recorder notes every collective and point-to-point operation of every process group in the process, with its
input and output sizes and dtypes; it is on by default with a ring of 2000 entries (``TORCH_FR_BUFFER_SIZE``).
:class:`PayloadCounter` reads the recorder (without stack traces) and counts each entry once by its ``record_id``.

These are **payload** bytes, not wire bytes: an entry's inputs are what this rank handed to the collective ("sent"),
its outputs what the collective wrote back ("received"). A ring all-reduce of ``P`` bytes over ``n`` ranks puts about
``2 (n - 1) / n * P`` bytes on each rank's link in each direction; a broadcast root sends ``P`` to each receiver.

One dump costs about 10 microseconds per entry in the ring (about 20 ms for a full ring of 2000), whatever the
number of new entries, so :meth:`PayloadCounter.due` polls as rarely as the ring allows: when about half of it may
have been written since the last poll. Entries overwritten before a poll are counted in :attr:`PayloadCounter.lost`.
"""

from __future__ import annotations

import os
import pickle
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Collective", "PayloadCounter", "payload_nbytes", "ring_size"]

_DTYPE_BYTES = {
    "Bool": 1,
    "Byte": 1,
    "Char": 1,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
    "Short": 2,
    "Half": 2,
    "BFloat16": 2,
    "Int": 4,
    "Float": 4,
    "Long": 8,
    "Double": 8,
    "ComplexHalf": 4,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
}


def ring_size() -> int:
    """The Flight Recorder's ring size in this process: ``TORCH_FR_BUFFER_SIZE`` (or its NCCL alias), else 2000."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 2000


def payload_nbytes(sizes: list[list[int]], dtypes: list[str]) -> int:
    """Bytes of tensors with these shapes and Flight Recorder dtype names (``'Float'``, ``'BFloat16'``...)."""
    total = 0
    for shape, dtype in zip(sizes, dtypes, strict=False):
        numel = 1
        for dim in shape:
            numel *= int(dim)
        total += numel * _DTYPE_BYTES.get(str(dtype), 4)
    return total


@dataclass(frozen=True)
class Collective:
    """One Flight Recorder entry, as counted.

    Attributes:
        record_id: the recorder's id, unique in the process.
        name: e.g. ``"gloo:all_reduce"``.
        group: the process group's description, e.g. ``"default_pg"``.
        created_ns: :func:`time.time_ns` when it was enqueued.
        sent: payload bytes handed in.
        received: payload bytes written back.

    """

    record_id: int
    name: str
    group: str
    created_ns: int
    sent: int
    received: int


def _collective(entry: dict[str, Any]) -> Collective:
    name = str(entry.get("profiling_name", ""))
    sent = payload_nbytes(entry.get("input_sizes") or [], entry.get("input_dtypes") or [])
    received = payload_nbytes(entry.get("output_sizes") or [], entry.get("output_dtypes") or [])
    if name.endswith(("send", "isend")):
        received = 0
    elif name.endswith(("recv", "irecv", "recv_any_source")):
        sent = 0
    group = entry.get("process_group") or ("", "")
    return Collective(
        int(entry["record_id"]), name, str(group[1] if len(group) > 1 else group), int(entry["time_created_ns"] or 0),
        sent, received,
    )  # fmt: skip


@dataclass
class PayloadCounter:
    """Counts this rank's collective payload from the Flight Recorder, each entry once.

    Attributes:
        sent: payload bytes handed to collectives since :meth:`start`.
        received: payload bytes written back by them.
        collectives: operations counted, by name.
        lost: entries overwritten in the ring before a poll saw them.
        available: ``False`` once the recorder proved unavailable or off (``TORCH_FR_BUFFER_SIZE=0``).

    """

    sent: int = 0
    received: int = 0
    collectives: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    available: bool = True
    _last_id: int = -1
    _per_step: float = 0.0

    def start(self) -> None:
        """Skip what the recorder holds now (set-up collectives), so later polls count from here."""
        self.sent = self.received = self.lost = 0
        self.collectives = Counter()
        self.available = ring_size() > 0
        entries = self._dump()
        self._last_id = max((int(e["record_id"]) for e in entries), default=self._last_id)

    def due(self, steps_since_poll: int) -> bool:
        """Whether to poll now: half the ring may have been written, judged by the entries per step seen so far."""
        if not self.available:
            return False
        if self._per_step <= 0:
            return steps_since_poll >= 10  # learn the rate early
        return steps_since_poll * self._per_step >= ring_size() / 2

    def poll(self, steps_since_poll: int = 0) -> list[Collective]:
        """Count the entries recorded since the last poll and return them (oldest first)."""
        fresh = []
        entries = self._dump()
        for entry in entries:
            if int(entry["record_id"]) > self._last_id:
                fresh.append(_collective(entry))
        fresh.sort(key=lambda c: c.record_id)
        if fresh:
            self.lost += max(0, fresh[0].record_id - self._last_id - 1) if self._last_id >= 0 else 0
            self._last_id = fresh[-1].record_id
        for item in fresh:
            self.sent += item.sent
            self.received += item.received
            self.collectives[item.name] += 1
        if steps_since_poll > 0:
            self._per_step = max(self._per_step, len(fresh) / steps_since_poll)
        return fresh

    def _dump(self) -> list[dict[str, Any]]:
        if not self.available:
            return []
        try:
            import torch._C._distributed_c10d as c10d

            dump = c10d._dump_fr_trace  # type: ignore[attr-defined]  # not in torch's stubs
            raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        except (ImportError, RuntimeError, AttributeError):
            self.available = False
            return []
        return list(pickle.loads(raw).get("entries", []))  # torch's own dump of this process
