"""torch's Flight Recorder as the hang diagnosis reads it: snapshots of this process's collectives, and dump files.

Every process group of the process records its collectives in one ring buffer (on by default in the torch we pin,
2000 entries; ``TORCH_FR_BUFFER_SIZE`` sets the size, 0 turns it off), gloo's as well as NCCL's. On gloo an entry's
``state`` stays "scheduled" and it has no start or end time: ``retired`` (False while the call waits) is the one live
signal, and a call that timed out is marked retired like one that completed. So the diagnosis snapshots the buffer
*while* a call waits. A snapshot from another thread is safe while the main thread is blocked in a collective (gloo
releases the GIL).

Dump files are what torch's analyzer (``torch.distributed.flight_recorder``, ``torchfrtrace``) reads: one pickle per
rank, named ``<prefix><rank>``. gloo writes a wrong ``pg_config`` into them (an empty group name, and no ranks once
``new_group`` was called, because Python names the group after the backend recorded it), which the analyzer cannot
read; :func:`write_dump` puts the process groups' names, descriptions and global ranks from Python in its place.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

__all__ = ["DUMP_PREFIX", "Snapshot", "pg_table", "read_dump", "recorder_size", "snapshot", "write_dump"]

#: The file name of rank r's dump is ``f"{DUMP_PREFIX}{r}"`` (the analyzer finds the rank after a common prefix).
DUMP_PREFIX = "fr_rank_"
DEFAULT_BUFFER = 2000

Snapshot = dict[str, Any]


def recorder_size() -> int:
    """How many entries the recorder keeps (0: switched off with ``TORCH_FR_BUFFER_SIZE=0``)."""
    for variable in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = os.environ.get(variable)
        if value is not None and value.strip().lstrip("-").isdigit():
            return max(0, int(value))
    return DEFAULT_BUFFER


def snapshot(stacks: bool = False, only_active: bool = False) -> Snapshot:
    """The recorder's entries now, as a dict (``entries``, ``pg_config``, ``pg_status``, ``version``).

    Args:
        stacks: include each call's Python stack (``frames``); the first such snapshot of a process takes about a
            second while symbols load, later ones well under a millisecond.
        only_active: only the calls still waiting.

    """
    return pickle.loads(_c10d._dump_fr_trace(True, stacks, only_active))  # type: ignore[attr-defined]  # private


def pg_table() -> dict[str, dict[str, str]]:
    """Every live process group as the analyzer wants it: name -> name, description and global ranks (as text)."""
    table: dict[str, dict[str, str]] = {}
    if not dist.is_initialized():
        return table
    world = dist.distributed_c10d._world
    for group, name in world.pg_names.items():
        ranks = sorted(world.pg_group_ranks.get(group, {}))
        table[name] = {"name": name, "desc": getattr(group, "group_desc", "") or name, "ranks": str(ranks)}
    return table


def fix_pg_config(dump: Snapshot, table: dict[str, dict[str, str]]) -> Snapshot:
    """``dump`` with the process groups its entries name described by ``table`` (see the module's docs)."""
    fixed = dict(table)
    broken = dump.get("pg_config", {})
    for name, desc in {tuple(entry["process_group"]) for entry in dump.get("entries", [])}:
        if name not in fixed:  # a group Python no longer lists (destroyed): keep what the backend recorded
            recorded = broken.get(name) or broken.get("") or {"ranks": "[]"}
            fixed[name] = {"name": name, "desc": desc, "ranks": recorded["ranks"]}
        elif desc:
            fixed[name] = {**fixed[name], "desc": desc}
    return {**dump, "pg_config": fixed}


def write_dump(folder: Path, rank: int, dump: Snapshot, table: dict[str, dict[str, str]] | None = None) -> Path:
    """Write rank ``rank``'s ``dump`` where the analyzer reads it, ``folder/fr_rank_<rank>``; returns the path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{DUMP_PREFIX}{rank}"
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(pickle.dumps(fix_pg_config(dump, pg_table() if table is None else table)))
    os.replace(temporary, path)
    return path


def read_dump(path: Path) -> Snapshot:
    """A dump file written by :func:`write_dump` (or by torch)."""
    return pickle.loads(path.read_bytes())
