"""ds_mirrored on 2 simulated hosts x 2 processes: one launch of this script per host, ``NODE_RANK`` set.

Usage: ``NODE_RANK=n python -m tests.helpers.hierarchical_run OUT HIERARCHICAL COMPRESSION`` (``HIERARCHICAL`` is
``auto``, ``true`` or ``false``); Lightning starts the host's second process. Each rank writes ``OUT.rank{r}.pt`` with
the initial and final parameters and the strategy's ``comm_bytes_per_step``.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

import ds_lightning
from tests.helpers.models import TinyData, TinyModule

STEPS = 4


class Record(Callback):
    def __init__(self, out: str) -> None:
        self.out = out
        self.initial: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.initial = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "initial": self.initial,
            "params": [p.detach().clone() for p in pl_module.parameters()],
            "bytes": trainer.strategy.comm_bytes_per_step,
            "node_rank": trainer.node_rank,
        }
        torch.save(record, f"{self.out}.rank{trainer.global_rank}.pt")


def main(out: str, hierarchical: str, compression: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    setting = {"auto": "auto", "true": True, "false": False}[hierarchical]
    strategy = ds_lightning.MirroredStrategy(
        timeout=timedelta(seconds=120), hierarchical=setting, gradient_compression=compression
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Record(out)],
        default_root_dir=out + ".root",
    )
    trainer.fit(TinyModule(), datamodule=TinyData())


if __name__ == "__main__":
    main(*sys.argv[1:4])
