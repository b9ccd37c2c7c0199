"""Saving and loading a sharded checkpoint with ``torch.distributed.checkpoint`` (DCP): every rank writes its part.

DCP's default save planner writes a tensor that several ranks hold under the same key once (it balances such tensors
over the ranks), a DTensor as its shards, and a key only one rank holds from that rank; on load each rank asks for the
tensors it holds, in its current layout, and DCP reads the pieces (resharding across world sizes and engines).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ds_lightning.checkpoint.layout import SavedShards, rank_key, remove_path, saved_entries, set_nested, write_meta

__all__ = ["ShardedGroup", "ShardedWriter", "load_into", "load_rank_state", "save_sharded", "write_parts"]


@dataclass(frozen=True)
class ShardedGroup:
    """Which processes take part in a sharded save or load, and how they coordinate.

    Attributes:
        saves: whether this process writes (``False``: it has no part, e.g. a parameter-server worker that is not the
            chief); a process that does not save skips the save, which then must not be collective over it.
        process_group: the group DCP coordinates over (``None``: the default group); every process of it saves.
        no_dist: this process saves and loads alone, with no collective (one process, or the parameter server's chief,
            which holds the servers' state).
        coordinator: whether this process writes ``meta.pt`` (exactly one per checkpoint; DCP's coordinator is rank 0
            of ``process_group``, which must be this process).
        remote_writer: other processes write the DCP files in place of this one (the parameter servers): called with
            this process's part and the folder, it returns entries for ``meta.pt``. ``None``: DCP writes here.

    """

    saves: bool = True
    process_group: dist.ProcessGroup | None = None
    no_dist: bool = False
    coordinator: bool = True
    remote_writer: Callable[[dict[str, Any], Path], dict[str, Any]] | None = None

    @classmethod
    def every_rank(cls, is_global_zero: bool) -> ShardedGroup:
        """Every rank of the default group (or this process alone when no process group is up)."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return cls(no_dist=not distributed, coordinator=is_global_zero)


@runtime_checkable
class ShardedWriter(Protocol):
    """A ``CheckpointIO`` that writes sharded checkpoints itself (``BackupWriter``: asynchronously, then committed)."""

    def save_sharded(self, state: dict[str, Any], meta: dict[str, Any], path: Path, group: ShardedGroup) -> None:
        """Write ``state`` (this rank's part, via DCP) and ``meta`` (on the coordinator) as the folder ``path``."""


def write_parts(state: dict[str, Any], path: Path, group: ShardedGroup) -> dict[str, Any]:
    """Write the DCP files into the existing folder ``path``, here or by ``group.remote_writer``; entries for meta.pt.

    Collective over ``group`` (unless ``no_dist``). Ends once the files and ``.metadata`` are written.
    """
    if group.remote_writer is not None:
        return group.remote_writer(state, path)
    dcp.save(state, storage_writer=FileSystemWriter(path), process_group=group.process_group, no_dist=group.no_dist)
    return {}


def save_sharded(state: dict[str, Any], meta: dict[str, Any], path: Path, group: ShardedGroup) -> None:
    """Write the folder ``path`` synchronously: DCP files from every saving rank, then ``meta.pt`` from the coordinator.

    Collective over ``group`` (unless ``no_dist``): every saving rank calls it. An existing file or folder at ``path``
    is replaced.
    """
    if group.coordinator:
        # Before DCP's first collective: no rank writes a file until every rank has planned, so none is removed here.
        remove_path(path)
        path.mkdir(parents=True, exist_ok=True)
    written = write_parts(state, path, group)
    if group.coordinator:
        # DCP's coordinator wrote .metadata after every rank's files were written: the data is complete.
        write_meta({**meta, **written}, path)


def load_into(targets: dict[str, Any], path: os.PathLike[str] | str, group: ShardedGroup) -> None:
    """Fill ``targets`` (this rank's tensors, in its current layout, under the saved keys) from the folder, in place.

    Collective over ``group`` unless ``no_dist``. A key of ``targets`` the folder lacks fails (DCP's strict planner).
    """
    dcp.load(targets, storage_reader=FileSystemReader(path), process_group=group.process_group, no_dist=group.no_dist)


def load_rank_state(source: SavedShards, rank: int, group: ShardedGroup) -> dict[str, Any] | None:
    """``rank``'s part of a :class:`~ds_lightning.checkpoint.layout.PerRankState` entry, read by this process alone.

    Collective over ``group`` (unless ``no_dist``): every rank calls it, also one with no part. Returns ``None`` when
    the folder holds no part for ``rank`` (written at a smaller world size, or with an empty state).
    """
    part: dict[str, Any] = {}
    for path, placeholder in saved_entries(source, under=(rank_key(rank),)):
        set_nested(part, path, placeholder)
    targets = {source.key: {rank_key(rank): part}} if part else {}
    load_into(targets, source.path, group)
    return part or None
