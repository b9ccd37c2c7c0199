"""Where a run stands, beyond what Lightning saves: each rank's random states and the sample it reached.

Lightning counts the run's position in batches; a batch is ``batch_size x world_size`` samples, so on another number
of processes the same position is another number of batches. These helpers count it in samples and move Lightning's
counters to match.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

__all__ = [
    "attach_loader_states",
    "detach_loader_states",
    "draw_as_the_next_epoch_starts",
    "move_batch_counters",
    "random_states",
    "set_random_states",
]

#: where Lightning's fit loop keeps the state of the training loaders that have one, in a checkpoint
_LOADER_STATES = ("loops", "fit_loop", "state_dict", "combined_loader")


def random_states() -> dict[str, Any]:
    """This process's random states, as tensors and plain numbers (they load with ``weights_only=True``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_random_states(states: dict[str, Any]) -> None:
    """Restore :func:`random_states`' output."""
    torch.set_rng_state(states["torch"])
    version, keys, gauss = states["python"]
    random.setstate((version, tuple(keys), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        for device, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def move_batch_counters(trainer: Any, batches: int) -> None:
    """Shift the epoch's batch counters of a restored ``trainer`` so that ``batches`` batches count as processed.

    Used when a backup from another world size is restored: Lightning's counters are in batches of the old size.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    delta = batches - progress.current.processed
    for tracker in (progress.current, progress.total):
        for field in ("ready", "started", "processed", "completed"):
            setattr(tracker, field, max(0, getattr(tracker, field) + delta))


def draw_as_the_next_epoch_starts(train_dataloader: Any) -> None:
    """Draw from torch's generator what starting the next epoch's iterators of ``train_dataloader`` draws.

    A backup taken at an epoch's last batch holds the random states from before the next epoch's iterators exist.
    Starting an iterator, a ``DataLoader`` draws its workers' base seed (one int64) from torch's generator; the
    uninterrupted run does so when the next epoch starts, after the backup's states. A run restored there trains that
    epoch on iterators Lightning made while it set up its data, before the states were restored: without this draw its
    dropout masks would be those of another run. (A backup inside an epoch needs nothing: both runs drew when that
    epoch started, before the states.)
    """
    for loader in _leaves(train_dataloader):
        persistent = loader.persistent_workers and loader.num_workers > 0  # a second epoch reuses its iterator
        if not persistent and loader.generator is None:
            torch.empty((), dtype=torch.int64).random_()


def _leaves(loaders: Any) -> Iterator[DataLoader]:
    if isinstance(loaders, DataLoader):
        yield loaders
    elif isinstance(loaders, dict):
        for value in loaders.values():
            yield from _leaves(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from _leaves(value)


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    node: Any = checkpoint
    for key in _LOADER_STATES[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def detach_loader_states(checkpoint: dict[str, Any], ours: bool) -> list[Any] | None:
    """Take the training loaders' states out of Lightning's part of ``checkpoint`` when ``ours`` (ours alone made them).

    A ds strategy under ``BackupAndRestore`` trains from a loader with a state (its order's seed, for a warning), and
    Lightning refuses to resume a checkpoint holding loader states into a Trainer whose loaders have none ("The
    CombinedLoader has 0 stateful loaders, but found 1 states"): a plain one-device Trainer without the callback. Kept
    beside the callback's own entry instead, the checkpoint loads anywhere, and :func:`attach_loader_states` puts it
    back for a Trainer that has the callback.
    """
    loop = _fit_loop_state(checkpoint)
    if not ours or loop is None or _LOADER_STATES[-1] not in loop:
        return None
    return loop.pop(_LOADER_STATES[-1])


def attach_loader_states(checkpoint: dict[str, Any], states: list[Any] | None) -> None:
    """Hand :func:`detach_loader_states`' states back to Lightning's fit loop before it restores them."""
    loop = _fit_loop_state(checkpoint)
    if states and loop is not None and _LOADER_STATES[-1] not in loop:
        loop[_LOADER_STATES[-1]] = states
