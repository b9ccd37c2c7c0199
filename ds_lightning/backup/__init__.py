"""The engine behind :class:`~ds_lightning.callbacks.BackupAndRestore`.

Atomic backup files, a background writer, preemption signals, and the run's position (loop counters, data, random
states) across a restore.
"""

from ds_lightning.backup.preemption import PreemptionWatch
from ds_lightning.backup.store import BackupStore
from ds_lightning.backup.writer import BackupWriter

__all__ = ["BackupStore", "BackupWriter", "PreemptionWatch"]
