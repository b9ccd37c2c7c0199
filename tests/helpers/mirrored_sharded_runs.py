"""Several ``ds_mirrored`` fits with ``state_dict_type="sharded"`` in one launch; each rank runs the arms in turn.

Usage: ``python -m tests.helpers.mirrored_sharded_runs SPEC.json``, started once per rank (``run_ranks``). The spec
is ``{"arms": [...]}``; each arm is

- ``name``, ``engine`` (a key of :data:`ENGINES`), ``out`` (the folder its files go to);
- ``max_steps`` (default: to the end of 2 epochs, :data:`STEPS` optimizer steps);
- ``backup_every``: ``BackupAndRestore`` backs up every n steps into ``{out}/{name}_backups`` (keeping all);
- ``ckpt_path``: a sharded folder to resume from (``BackupAndRestore`` then positions the data where it stood);
- ``fresh_optimizer``: the resume leaves the optimizer state as it starts (the control of an exact resume).

The process group comes up with the first arm and stays for the others (every arm has the same world size and a
60 s collective timeout). Each arm ends with ``trainer.save_checkpoint("{out}/{name}.ckpt")``, a sharded folder, and
rank 0 writes ``{out}/{name}.json`` (global step, seconds).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.utils.data import DataLoader

from ds_lightning.callbacks import BackupAndRestore
from ds_lightning.strategies import MirroredStrategy
from tests.helpers.backup_runs import Net, make_data

N = 96  # samples: 6 optimizer steps per epoch at a global batch of 16
GLOBAL_BATCH = 16
STEPS = 12
ENGINES: dict[str, dict[str, Any]] = {
    "zero": {"shard_optimizer_state": True, "sharding_engine": "zero"},
    "fsdp2": {"shard_optimizer_state": True, "sharding_engine": "fsdp2"},
    "zero3": {"shard_parameters": True, "cpu_offload": True},
}


@contextlib.contextmanager
def optimizer_left_fresh(fresh: bool) -> Iterator[None]:
    """While on, a restore from a sharded folder keeps every optimizer's state as it starts (no engine loads it)."""
    if not fresh:
        yield
        return
    with mock.patch.object(MirroredStrategy, "load_sharded_optimizer_states", lambda self, sources: None):
        yield


def run_arm(arm: dict[str, Any], world_size: int) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    out = Path(arm["out"])
    every = arm.get("backup_every")
    backups = BackupAndRestore(str(out / f"{arm['name']}_backups"), every_n_train_steps=every, keep=STEPS)
    strategy = MirroredStrategy(**ENGINES[arm["engine"]], state_dict_type="sharded", timeout=60)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_epochs=2,
        max_steps=arm.get("max_steps", -1),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[backups],
        default_root_dir=str(out),
    )
    loader = DataLoader(make_data(N), batch_size=GLOBAL_BATCH // world_size, shuffle=True)
    start = time.monotonic()
    with optimizer_left_fresh(arm.get("fresh_optimizer", False)):
        trainer.fit(Net(), loader, ckpt_path=arm.get("ckpt_path"))
    trainer.save_checkpoint(out / f"{arm['name']}.ckpt")
    if trainer.global_rank == 0:
        summary = {"global_step": trainer.global_step, "seconds": time.monotonic() - start}
        (out / f"{arm['name']}.json").write_text(json.dumps(summary))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    world_size = int(spec["world_size"])
    for arm in spec["arms"]:
        run_arm(arm, world_size)


# --- reading the results (in the test process) -----------------------------------------------------------------------


def final_params(folder: Path) -> dict[str, torch.Tensor]:
    """The model a sharded folder holds, read whole in this process as Lightning's consolidation reads it."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    return _load_distributed_checkpoint(folder)["model"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def tensor_bytes_per_file(folder: Path, prefix: str) -> dict[str, int]:
    """The tensor payload under top-level key ``prefix`` that each DCP file of ``folder`` holds (one file per writing
    rank), from its ``.metadata``: the chunks each rank wrote, so a DTensor's shards count where they were written."""
    metadata = FileSystemReader(folder).read_metadata()
    written: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        saved = metadata.state_dict_metadata[index.fqn]
        if not index.fqn.startswith(f"{prefix}.") or not isinstance(saved, TensorStorageMetadata):
            continue
        chunk = next(c for c in saved.chunks if list(c.offsets) == list(index.offset or [0] * len(c.offsets)))
        written[info.relative_path] = (
            written.get(info.relative_path, 0) + chunk.sizes.numel() * saved.properties.dtype.itemsize
        )
    return written


if __name__ == "__main__":
    main(sys.argv[1])
