"""The sharded checkpoint's folder: Lightning FSDP's layout, so its tools (``consolidate_checkpoint``) read ours.

A sharded checkpoint is a folder holding

- the files of ``torch.distributed.checkpoint`` (``.metadata`` and one ``__{rank}_0.distcp`` per writing rank) with the
  tensor state under two kinds of top-level keys: ``"model"`` (the module's state by parameter FQN, as in the
  unsharded model) and ``"optimizer_{i}"`` (optimizer ``i``'s state keyed by parameter FQN, the layout of
  ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``);
- ``meta.pt``: every other entry of Lightning's checkpoint dict (loops, callbacks, schedulers, ...), written by the
  coordinator alone (``torch.save``), last: a folder holding ``meta.pt`` is complete.

``python -m lightning.pytorch.utilities.consolidate_checkpoint <folder>`` turns it into one file a single-process
Trainer resumes from: ``torch.optim.Optimizer.load_state_dict`` maps the saved parameters by position in the param
groups, so FQN keys load like numbers.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = [
    "META_FILENAME",
    "MODEL_KEY",
    "PerRankState",
    "SavedShards",
    "atomic_save",
    "holds_optimizer_state",
    "is_sharded_checkpoint",
    "optimizer_key",
    "rank_key",
    "read_checkpoint",
    "read_part",
    "remove_path",
    "saved_entries",
    "split_checkpoint",
    "write_meta",
]

#: Lightning's name for the non-tensor entries (``lightning.fabric.utilities.load._METADATA_FILENAME``).
META_FILENAME = "meta.pt"
MODEL_KEY = "model"
_OPTIMIZER_KEY = re.compile(r"^optimizer_(\d+)$")


def optimizer_key(index: int) -> str:
    """The top-level key of optimizer ``index``'s state (Lightning FSDP's)."""
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a complete sharded checkpoint folder (Lightning's test: a folder holding ``meta.pt``)."""
    folder = Path(path)
    return folder.is_dir() and (folder / META_FILENAME).is_file()


@dataclass(frozen=True)
class SavedShards:
    """Stands, in a loaded checkpoint dict, for a part left in the folder until the strategy loads it in place.

    ``checkpoint["state_dict"]`` is one (key ``"model"``) and ``checkpoint["optimizer_states"]`` a list of them: each
    rank then asks ``torch.distributed.checkpoint`` for exactly the tensors it holds, and none is read whole.

    Attributes:
        path: the checkpoint folder.
        key: the top-level key (``"model"``, ``"optimizer_0"``, ...).

    """

    path: Path
    key: str


@dataclass(frozen=True)
class PerRankState:
    """A value of Lightning's checkpoint dict that differs per rank: each rank writes its own ``state`` in the folder.

    Attributes:
        rank: the writing rank (its part is ``"rank_<rank>"`` under the entry's key).
        state: tensors and plain values (nested dicts; an empty dict is not written, so loaders take it as absent).

    """

    rank: int
    state: dict[str, Any]


def rank_key(rank: int) -> str:
    """The key of ``rank``'s part under a :class:`PerRankState` entry."""
    return f"rank_{rank}"


def set_nested(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """``state[path[0]][path[1]]... = value``, making the dicts on the way."""
    node = state
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict as ``(this rank's state for DCP, the rest for meta.pt)`` (``checkpoint`` is kept)."""
    meta = dict(checkpoint)
    state: dict[str, Any] = {MODEL_KEY: meta.pop("state_dict", {})}
    for index, optimizer_state in enumerate(meta.pop("optimizer_states", [])):
        state[optimizer_key(index)] = optimizer_state
    for key, value in checkpoint.items():
        if isinstance(value, PerRankState):
            state[key] = {rank_key(value.rank): meta.pop(key).state}
    return state, meta


def _saved_paths(path: Path) -> dict[tuple[Any, ...], Any]:
    """Each entry of the folder's DCP files: its path in the saved state dict -> its storage metadata."""
    metadata = FileSystemReader(path).read_metadata()
    paths = metadata.planner_data or {}
    return {tuple(paths.get(flat, flat.split("."))): saved for flat, saved in metadata.state_dict_metadata.items()}


def saved_keys(path: Path) -> set[str]:
    """The top-level keys the folder's DCP files hold (``"model"``, ``"optimizer_0"``, ...)."""
    return {str(saved_path[0]) for saved_path in _saved_paths(path)}


def holds_optimizer_state(source: SavedShards) -> bool:
    """Whether the optimizer part ``source`` holds any per-parameter state (none when saved before its first step)."""
    return any(saved_path[:2] == (source.key, "state") for saved_path in _saved_paths(source.path))


def saved_entries(source: SavedShards, under: tuple[str, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path below source.key + under, placeholder)`` for each entry of the part saved below that path.

    Placeholders are zero tensors of the saved shape and dtype, ``None`` for other values: DCP fills both in place.
    """
    prefix = (source.key, *under)
    entries = []
    for saved_path, saved in _saved_paths(source.path).items():
        if saved_path[: len(prefix)] != prefix:
            continue
        if isinstance(saved, TensorStorageMetadata):
            placeholder: Any = torch.zeros(saved.size, dtype=saved.properties.dtype)
        else:
            placeholder = None
        entries.append((saved_path[len(prefix) :], placeholder))
    return entries


def read_checkpoint(path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
    """A sharded checkpoint as Lightning's checkpoint dict, with :class:`SavedShards` for the tensor parts.

    Args:
        path: the folder.
        weights_only: passed to ``torch.load`` for ``meta.pt`` (``None``: ``True``, torch's default).

    """
    folder = Path(path)
    checkpoint: dict[str, Any] = torch.load(
        folder / META_FILENAME, map_location="cpu", weights_only=weights_only is not False
    )
    keys = saved_keys(folder)
    if MODEL_KEY in keys:
        checkpoint["state_dict"] = SavedShards(folder, MODEL_KEY)
    optimizers = sorted(int(m.group(1)) for key in keys if (m := _OPTIMIZER_KEY.match(key)))
    if optimizers:
        checkpoint["optimizer_states"] = [SavedShards(folder, optimizer_key(i)) for i in range(len(optimizers))]
    for key in keys - {MODEL_KEY} - {optimizer_key(i) for i in optimizers}:
        checkpoint[key] = SavedShards(folder, key)  # a PerRankState entry: each rank loads its own part
    return checkpoint


def read_part(source: SavedShards) -> Any:
    """One part whole, in this process (no collective): for a process that holds it all (the parameter server's chief).

    Rebuilt from the folder's own metadata (DCP's ``_EmptyStateDictLoadPlanner``, which Lightning's consolidation uses
    too), so nothing of the model is needed.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    # The private loader, as Lightning's consolidation uses it: the public load() reads only the keys it is given.
    planner = _EmptyStateDictLoadPlanner(keys={source.key})
    _load_state_dict(state, storage_reader=FileSystemReader(source.path), planner=planner, no_dist=True)
    return state[source.key]


def atomic_save(obj: Any, target: Path) -> None:
    """``torch.save`` to ``target`` atomically: a temporary name beside it, synced, then renamed over it."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_meta(meta: dict[str, Any], folder: Path) -> None:
    """Write ``meta.pt`` into ``folder`` atomically: it marks the folder whole."""
    atomic_save(meta, folder / META_FILENAME)


def remove_path(path: Path) -> None:
    """Remove a file or a folder at ``path``, if any.

    Another rank's checkpoint writer may create the folder at any moment (DCP makes it on every rank), so the kind of
    path is learnt from the removal that fails, not from a check made before it.
    """
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except (IsADirectoryError, PermissionError):  # a folder (Linux says IsADirectory, macOS PermissionError)
        shutil.rmtree(path, ignore_errors=True)
