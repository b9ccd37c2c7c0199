"""Backup files: written under a temporary name, synced and renamed, so a crash mid-write leaves the last one whole.

A sharded backup (``state_dict_type="sharded"``) is a folder in the same place under the same name: every rank writes
its part into a hidden temporary folder, and the coordinator renames it once every part and ``meta.pt`` are in.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

from ds_lightning.checkpoint.layout import atomic_save, remove_path, write_meta

__all__ = ["BackupStore"]

_NAME = re.compile(r"^backup-step(\d+)\.ckpt$")


class BackupStore:
    """The backups in one directory: ``backup-step{N:09d}.ckpt``, newest by step, the last ``keep`` kept.

    A backup is a file, or a sharded checkpoint folder (:mod:`ds_lightning.checkpoint.layout`). Only complete ones
    carry that name (a write goes to a hidden temporary file that is renamed when synced), so
    whatever :meth:`latest` returns loads.

    Args:
        directory: where backups live; every process of a run must see the same directory (shared storage on a
            cluster).
        keep: how many of the newest backups to keep.

    """

    def __init__(self, directory: str | os.PathLike[str], keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        """Where the backup after optimizer step ``step`` goes."""
        return self.directory / f"backup-step{step:09d}.ckpt"

    def backups(self) -> list[tuple[int, Path]]:
        """Every complete backup as ``(step, path)``, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete backup, or ``None``."""
        found = self.backups()
        return found[-1][1] if found else None

    def write(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write ``checkpoint`` to ``path`` atomically, then drop all but the newest ``keep`` backups."""
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_save(checkpoint, path)
        _fsync_directory(self.directory)  # the rename itself survives a power cut
        self.prune()

    def prune(self) -> None:
        """Remove all but the newest ``keep`` backups."""
        for _, old in self.backups()[: -self.keep]:
            remove_path(old)

    def remove_stale_temporaries(self) -> None:
        """Delete the temporary files and folders of writes that never finished (call when no write is running)."""
        if self.directory.is_dir():
            for p in self.directory.glob(".backup-step*.ckpt.tmp-*"):
                remove_path(p)

    def temporary_folder(self, path: Path) -> Path:
        """Where the ranks write the sharded backup ``path`` before it is committed (one name on every rank)."""
        return path.with_name(f".{path.name}.tmp-sharded")

    def commit_folder(self, meta: dict[str, Any], folder: Path, path: Path) -> None:
        """Complete the sharded backup written into ``folder``: add ``meta.pt``, rename it to ``path``, prune.

        Call on the coordinator only, once every rank's part is written (DCP's save has returned there): until the
        rename, :meth:`latest` does not see it, so a kill at any moment before leaves the previous backup the latest.
        """
        write_meta(meta, folder)
        _fsync_directory(folder)
        if path.exists():  # the same step backed up again (a rerun): the older copy goes
            remove_path(path)
        os.replace(folder, path)
        _fsync_directory(self.directory)  # the rename itself survives a power cut
        self.prune()


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot open a directory for syncing
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
