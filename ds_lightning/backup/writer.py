"""Writing backups off the training loop: the loop pays for a copy of the state, a thread for the file.

Sharded backups go through ``torch.distributed.checkpoint.async_save``: it copies each rank's part to host memory and
writes it from a thread; this writer's own thread then waits for it and commits the folder on the coordinator.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as _FutureTimeout
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from ds_lightning.backup.store import BackupStore
from ds_lightning.checkpoint.io import ShardedGroup, write_parts
from ds_lightning.checkpoint.layout import remove_path

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
    hand its own ``checkpoint_io``; a strategy with ``state_dict_type="sharded"`` hands every rank's part to
    :meth:`save_sharded` instead.

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
        #: A gloo group of the same ranks as the default one, for DCP's collectives in the background: on the default
        #: group they would interleave with training's (set by ``BackupAndRestore``; without it, sharded backups over
        #: the default group are written synchronously).
        self.async_group: dist.ProcessGroup | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        self.wait()
        if not self.async_save:
            self.store.write(checkpoint, Path(path))  # training waits for the file: no copy needed
            return
        snapshot = _detached_copy(checkpoint)
        self._pending = self._executor().submit(self.store.write, snapshot, Path(path))

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_lightning-backup")
        return self._pool

    def save_sharded(self, state: dict[str, Any], meta: dict[str, Any], path: Path, group: ShardedGroup) -> None:
        """Write this rank's part of a sharded backup into a temporary folder, and commit it once every part is in.

        Called on every saving rank at the same step. With ``async_save``, returns once DCP has copied the part to
        host memory; the previous backup stays the latest until the coordinator renames the folder.
        """
        self.wait()  # one write at a time, on every rank: the DCP collectives of two saves never overlap
        folder = self.store.temporary_folder(path)
        if group.coordinator:
            # Before DCP's first collective, so no rank has written into it yet: leftovers of a killed write go.
            remove_path(folder)
            folder.mkdir(parents=True, exist_ok=True)
        background = group if group.no_dist and group.remote_writer is None else None
        if group.process_group is None and not group.no_dist and self.async_group is not None:
            background = ShardedGroup(group.saves, self.async_group, False, group.coordinator)
        if not self.async_save or background is None:  # the parameter servers' writes are synchronous too
            written = write_parts(state, folder, group)
            if group.coordinator:
                self.store.commit_folder({**meta, **written}, folder, path)
            return
        meta = _detached_copy(meta)  # written after the parts, while training goes on changing its tensors
        upload = dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(folder),
            process_group=background.process_group,
            no_dist=background.no_dist,
        )
        self._pending = self._executor().submit(self._commit, upload, meta, folder, path, group.coordinator)

    def _commit(self, upload: Any, meta: dict[str, Any], folder: Path, path: Path, coordinator: bool) -> None:
        # DCP's save ends on every rank after its coordinator wrote .metadata, itself after every rank's parts.
        getattr(upload, "upload_completion", upload).result(timeout=self.timeout)
        if coordinator:
            self.store.commit_folder(meta, folder, path)

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
