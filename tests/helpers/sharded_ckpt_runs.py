"""``tests.helpers.backup_runs`` with sharded-checkpoint switches; Lightning relaunches this script for every rank.

Usage: ``python -m tests.helpers.sharded_ckpt_runs SPEC.json``. The spec is backup_runs' (``strategy_kwargs`` carries
``state_dict_type="sharded"``), plus:

- ``kill_in_write_at_step``: every rank exits with ``DIED`` inside DCP's write of the backup of that step, once its
  own part is on disk and before the backup is committed (a kill mid-write);
- ``skip_optimizer_restore``: a restore leaves the optimizer state as it starts (the control of exact resume);
- ``skip_compression_restore``: a restore leaves gradient compression's state (PowerSGD's error feedback) as it starts;
- ``save_at_train_start``: every rank saves a checkpoint to that path as training starts, before any optimizer step;
- ``state_at_train_start``: every rank asks torch's ``get_optimizer_state_dict`` for the optimizer's state as training
  starts, which creates it with a counted zero-lr step (the control of a save before the first step).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from tests.helpers import backup_runs
from tests.helpers.backup_runs import DIED


def kill_in_write(step: int) -> None:
    """Exit from DCP's write of the backup of ``step`` on this rank, after writing its part."""
    write = FileSystemWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        written = write(self, plan, planner)
        if f"backup-step{step:09d}" in str(self.path):
            written.wait()  # this rank's part is on disk; the coordinator has not committed the folder
            os._exit(DIED)
        return written

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


def skip_optimizer_restore() -> None:
    """Restores leave every optimizer state as it starts: the default path and the parameter server's."""
    from ds_lightning.checkpoint.strategy_hooks import ShardedCheckpoints
    from ds_lightning.parameter_server.checkpoint import ResumePoint
    from ds_lightning.parameter_server.chief_checkpoints import ChiefCheckpoints

    def keep_fresh(self: Any, sources: Any) -> None:
        return None

    def resume_without_optimizer(self: Any, checkpoint: Any) -> None:
        self._resume = ResumePoint.from_checkpoint({**checkpoint, "optimizer_states": []})

    ShardedCheckpoints.load_sharded_optimizer_states = keep_fresh  # type: ignore[method-assign]
    ChiefCheckpoints.load_optimizer_state_dict = resume_without_optimizer  # type: ignore[method-assign]


def skip_compression_restore() -> None:
    """Restores leave gradient compression's per-rank state as it starts (zero error feedback)."""
    from ds_lightning.comm.compression import GradientCompressor

    def keep_fresh(self: Any, state: Any, device: Any = None) -> None:
        return None

    GradientCompressor.load_state_dict = keep_fresh  # type: ignore[method-assign]


def at_train_start(save_to: str | None, torch_state: bool) -> None:
    """Save a checkpoint to ``save_to``, or create the optimizer state torch's way, as training starts."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    start = backup_runs.RecordIds.on_train_start

    def start_then_save(self: Any, trainer: Any, pl_module: Any) -> None:
        start(self, trainer, pl_module)
        if save_to is not None:
            trainer.save_checkpoint(save_to)
        if torch_state:
            get_optimizer_state_dict(pl_module, trainer.optimizers[0])

    backup_runs.RecordIds.on_train_start = start_then_save  # type: ignore[method-assign]


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("save_at_train_start") or spec.get("state_at_train_start"):
        at_train_start(spec.get("save_at_train_start"), bool(spec.get("state_at_train_start")))
    if spec.get("kill_in_write_at_step") is not None:
        kill_in_write(int(spec["kill_in_write_at_step"]))
    if spec.get("skip_optimizer_restore"):
        skip_optimizer_restore()
    if spec.get("skip_compression_restore"):
        skip_compression_restore()
    backup_runs.main(spec_path)


if __name__ == "__main__":
    main(sys.argv[1])
