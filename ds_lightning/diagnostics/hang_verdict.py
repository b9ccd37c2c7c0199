"""From every rank's view of a stuck collective to one verdict: who did not arrive, who called something else.

Each rank describes itself as a :class:`RankView` (JSON-friendly dicts travel through the rendezvous store): the
collectives it waits in, the last sequence number it issued on each process group, and where its main thread is.
:func:`judge` compares the views against the collective one rank waited in too long.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks

__all__ = ["Call", "HangVerdict", "RankView", "judge", "place_of", "stack_of_thread"]

_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step", "configure_optimizers")
_TRAINER_METHODS = ("backward", "optimizer_step", "save_checkpoint", "lr_scheduler_step", "barrier", "teardown")
#: Function names that are Lightning hooks: the innermost one on a stack says where in the loop a call was made.
HOOKS = frozenset(
    name
    for owner in (ModelHooks, DataHooks, CheckpointHooks, Callback)
    for name in vars(owner)
    if not name.startswith("_") and callable(getattr(owner, name))
) | frozenset(_STEP_METHODS + _TRAINER_METHODS)
#: Places inside ds_lightning worth naming on their own: (file name ending, function) -> description.
_OWN_PLACES = {
    ("backup/agreement.py", "start"): "BackupAndRestore's step agreement",
    ("backup/agreement.py", "collect"): "BackupAndRestore's step agreement",
    ("callbacks/backup_and_restore.py", "save"): "a BackupAndRestore backup",
    # Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training step.
    ("loops/training_epoch_loop.py", "_broadcast_sigterm_tensor"): "Lightning's SIGTERM broadcast before a step",
}

Frame = Mapping[str, Any]  # {"name", "filename", "line"}, as the Flight Recorder writes them


def place_of(frames: Sequence[Frame]) -> str:
    """Where a stack (innermost frame first) was in the training loop, with file and line.

    The innermost Lightning hook (or named place of ours) on the stack; the innermost frame when none matches.
    """
    for frame in frames:
        name, filename = str(frame.get("name", "")), str(frame.get("filename", ""))
        for (ending, function), description in _OWN_PLACES.items():
            if name == function and filename.endswith(ending):
                return f"{description} ({_short(filename)}:{frame.get('line')})"
        if name in HOOKS and "/torch/" not in filename:  # torch's own backward() is not Lightning's hook
            return f"{name} ({_short(filename)}:{frame.get('line')})"
    outside_torch = [f for f in frames if "/torch/" not in str(f.get("filename", ""))]
    if outside_torch or frames:
        first = (outside_torch or frames)[0]
        return f"{first.get('name')} ({_short(str(first.get('filename', '')))}:{first.get('line')})"
    return "unknown"


def stack_of_thread(ident: int | None) -> list[dict[str, Any]]:
    """The current stack of thread ``ident`` (innermost first), in the Flight Recorder's frame format."""
    frame: FrameType | None = sys._current_frames().get(ident) if ident is not None else None
    frames = []
    while frame is not None:
        frames.append({"name": frame.f_code.co_name, "filename": frame.f_code.co_filename, "line": frame.f_lineno})
        frame = frame.f_back
    return frames


def _short(filename: str) -> str:
    parts = filename.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


@dataclass
class Call:
    """One collective call as the Flight Recorder recorded it."""

    group: str  # the process group's name ("0" is the default group)
    group_desc: str
    seq: int  # collective_seq_id: counted per group
    op: str  # "all_reduce", "broadcast", ...
    sizes: list[Any]
    place: str  # where in the loop it was called (see place_of)
    waited_s: float = 0.0
    created_ns: int = 0  # when it was called (wall clock)

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], now_ns: int) -> Call:
        """From a Flight Recorder entry (``frames`` present when the snapshot took stacks)."""
        name, desc = entry["process_group"]
        return cls(
            group=str(name),
            group_desc=str(desc),
            seq=int(entry["collective_seq_id"]),
            op=str(entry["profiling_name"]).split(":")[-1],
            sizes=list(entry.get("input_sizes", [])),
            place=place_of(entry.get("frames", [])),
            waited_s=max(0.0, (now_ns - int(entry["time_created_ns"])) / 1e9),
            created_ns=int(entry["time_created_ns"]),
        )

    def describe(self) -> str:
        """One line: the operation, its sequence number and group, its sizes, where it was called."""
        return (
            f"{self.op} #{self.seq} on process group '{self.group_desc}' (sizes {self.sizes}), called from {self.place}"
        )


@dataclass
class RankView:
    """What one rank says about itself when another rank reports a stuck collective."""

    rank: int
    host: str
    waiting: list[Call] = field(default_factory=list)  # the collectives it waits in now
    last_seq: dict[str, int] = field(default_factory=dict)  # per group: the last collective it issued
    where: str = "unknown"  # its main thread's place in the loop

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly dict (what travels through the store)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankView:
        """The inverse of :meth:`to_json`."""
        waiting = [Call(**call) for call in data.get("waiting", [])]
        return cls(int(data["rank"]), str(data["host"]), waiting, dict(data.get("last_seq", {})), data.get("where", ""))


@dataclass
class HangVerdict:
    """Who is to blame for ``stuck``: ranks that never called it, ranks that called something else, silent ranks."""

    stuck: Call
    timeout_s: float
    arrived: list[int] = field(default_factory=list)
    missing: dict[int, str] = field(default_factory=dict)  # rank -> where it is instead
    desync: dict[int, Call] = field(default_factory=dict)  # rank -> the other collective it waits in
    silent: list[int] = field(default_factory=list)  # no answer: process gone, or host unreachable
    dump_dir: str | None = None
    after_s: float | None = None  # from the stuck call to this verdict
    names: dict[int, str] = field(default_factory=dict)  # ranks with a name of their own (a parameter server)

    @property
    def kind(self) -> str:
        """``desync``, ``missing``, ``silent``, or ``slow`` (every rank arrived: a link too slow for the timeout)."""
        if self.desync:
            return "desync"
        if self.missing:
            return "missing"
        return "silent" if self.silent else "slow"

    def message(self) -> str:
        """The verdict as the error note and the log print it."""
        lines = [f"ds_lightning hang diagnosis: {self.stuck.describe()} waited past timeout={self.timeout_s:g} s."]
        if self.missing:
            lines.append(f"Ranks that did not arrive: {sorted(self.missing)}.")
            lines += [f"  rank {r} is in {where}" for r, where in sorted(self.missing.items())]
        if self.desync:
            lines.append(f"Desync: rank(s) {sorted(self.desync)} called a different collective at the same point.")
            lines += [f"  rank {r} waits in {call.describe()}" for r, call in sorted(self.desync.items())]
            lines.append("  A rank skipped or added a collective (a branch on the rank, or on data only it sees).")
        if self.silent:
            named = ", ".join(f"{self.names[r]} (rank {r})" if r in self.names else f"rank {r}" for r in self.silent)
            lines.append(
                f"Did not answer: {named} (the process is gone, or its host cannot be reached: a cut link or a lost"
                " host)."
            )
        if self.kind == "slow":
            lines.append("Every rank arrived: the transfer itself is too slow for the timeout (a slow or lossy link).")
        if self.arrived:
            lines.append(f"Ranks waiting in it: {self.arrived}.")
        if self.dump_dir:
            lines.append(
                f"Flight Recorder dumps: {self.dump_dir} (read them again with `ds-train diagnose {self.dump_dir}`)."
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The verdict as ``verdict_rank<r>.json`` holds it, message included."""
        return {
            "kind": self.kind,
            "stuck": asdict(self.stuck),
            "timeout_s": self.timeout_s,
            "arrived": self.arrived,
            "missing": {str(r): w for r, w in self.missing.items()},
            "desync": {str(r): asdict(c) for r, c in self.desync.items()},
            "silent": self.silent,
            "dump_dir": self.dump_dir,
            "after_s": self.after_s,
            "message": self.message(),
        }


def judge(stuck: Call, timeout_s: float, ranks: Iterable[int], views: Mapping[int, RankView | None]) -> HangVerdict:
    """Compare every rank of ``stuck``'s group with it.

    A rank waiting in the same sequence number of the group with the same operation and sizes arrived; one waiting
    there in another operation or with other sizes is a desync; one whose last call on the group is earlier did not
    arrive (its view says where it is); one with no view did not answer.
    """
    verdict = HangVerdict(stuck, timeout_s)
    for rank in sorted(ranks):
        view = views.get(rank)
        if view is None:
            verdict.silent.append(rank)
            continue
        same_group = [call for call in view.waiting if call.group == stuck.group]
        there = next((call for call in same_group if call.seq == stuck.seq), None)
        if there is not None:
            if (there.op, there.sizes) == (stuck.op, stuck.sizes):
                verdict.arrived.append(rank)
            else:
                verdict.desync[rank] = there
        elif view.last_seq.get(stuck.group, 0) < stuck.seq:
            verdict.missing[rank] = view.where
        else:  # it passed this call already (it completed on its side): it waits elsewhere, or in a later call
            later = same_group[0] if same_group else None
            if later is not None:
                verdict.desync[rank] = later
            else:
                verdict.missing[rank] = f"{view.where} (past {stuck.op} #{stuck.seq} on its side)"
    return verdict
