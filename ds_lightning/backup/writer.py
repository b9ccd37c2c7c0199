"""Writing backups off the training loop: the loop pays for a copy of the state, a thread for the file."""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as _FutureTimeout
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from ds_lightning.backup.store import BackupStore

__all__ = ["BackupWriter"]


_SCALARS = (int, float, bool, str, bytes, type(None))


def _detached_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory: training goes on changing them in place during the write.

    Containers are rebuilt (``copy.copy`` keeps a state dict's ``_metadata``), other values are kept. A sequence of
    scalars (Python's random state is 625 ints) is kept whole: walking it item by item, as Lightning's
    ``apply_to_collection`` does, made most of the loop's wait for a small model.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            if not isinstance(value, _SCALARS):
                out[key] = _detached_copy(value)
        return out
    if isinstance(obj, (list, tuple)):
        if all(isinstance(v, _SCALARS) for v in obj):
            return obj if isinstance(obj, tuple) else list(obj)
        items = [_detached_copy(v) for v in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # a namedtuple takes fields
    return obj


class BackupWriter(CheckpointIO):
    """A ``CheckpointIO`` that writes through a :class:`BackupStore`, in a background thread when ``async_save``.

    A save first waits for the one before it, so at most one write runs and the files appear in step order. The
    strategy hands this writer the consolidated checkpoint on the process that writes (rank 0), exactly as it would
    hand its own ``checkpoint_io``.

    Args:
        store: where the files go.
        async_save: return once the state is copied to host memory; the file is written by a thread.
        timeout: seconds a save may wait for the write before it (``None``: no bound). ``BackupAndRestore`` sets the
            strategy's ``timeout``, so a hung file system fails the run like a hung collective would.

    """

    def __init__(self, store: BackupStore, async_save: bool, timeout: float | None = None) -> None:
        self.store = store
        self.async_save = async_save
        self.timeout = timeout
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        self.wait()
        if not self.async_save:
            self.store.write(checkpoint, Path(path))  # training waits for the file: no copy needed
            return
        snapshot = _detached_copy(checkpoint)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_lightning-backup")
        self._pending = self._pool.submit(self.store.write, snapshot, Path(path))

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its error.

        Raises:
            TimeoutError: the write took longer than ``timeout`` seconds.

        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result(timeout=self.timeout)
        except _FutureTimeout:
            self._pending = pending  # still in flight: a later wait may see it land
            where = self.store.directory
            raise TimeoutError(
                f"BackupAndRestore: writing a backup into {str(where)!r} took more than {self.timeout:g} s (the"
                " strategy's timeout). Check that the directory is writable, not full, and its file system not hung;"
                " or give the strategy a longer timeout."
            ) from None

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        return torch.load(path, map_location=map_location or "cpu", weights_only=weights_only is not False)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        Path(path).unlink(missing_ok=True)

    @override
    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)  # after wait(): idle, or its write is hung and waiting cannot help
                self._pool = None
