"""Backup files: written under a temporary name, synced and renamed, so a crash mid-write leaves the last one whole."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["BackupStore"]

_NAME = re.compile(r"^backup-step(\d+)\.ckpt$")


class BackupStore:
    """The backups in one directory: ``backup-step{N:09d}.ckpt``, newest by step, the last ``keep`` kept.

    Only complete files carry that name (a write goes to a hidden temporary file that is renamed when synced), so
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
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        _fsync_directory(self.directory)  # the rename itself survives a power cut
        self.prune()

    def prune(self) -> None:
        """Remove all but the newest ``keep`` backups."""
        for _, old in self.backups()[: -self.keep]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()

    def remove_stale_temporaries(self) -> None:
        """Delete the temporary files of writes that never finished (call when no write is running)."""
        if self.directory.is_dir():
            for p in self.directory.glob(".backup-step*.ckpt.tmp-*"):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot open a directory for syncing
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
