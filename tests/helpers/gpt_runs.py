"""One GPT training on the standard library's text from a JSON spec; Lightning relaunches this script per rank.

Usage: ``python -m tests.helpers.gpt_runs SPEC.json``. The spec names the strategy (``single``, ``ds_mirrored`` or
``ds_pipeline``), the processes and the batch per process; every run sees the same global batches. Rank 0 writes the
initial and final ``state_dict`` to ``{out}.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Subset

import ds_lightning
from ds_lightning.demos import GPT, TextDataModule
from tests.helpers.trainers import quiet_trainer

BLOCK = 16
WINDOWS = 64  # windows of real text trained on


def _strategy(spec: dict[str, Any]) -> Any:
    if spec["strategy"] == "ds_mirrored":
        return ds_lightning.MirroredStrategy(timeout=120)
    if spec["strategy"] == "ds_pipeline":
        return ds_lightning.PipelineStrategy(n_microbatches=2, timeout=120)
    return "auto"


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    data = TextDataModule(block_size=BLOCK, batch_size=spec["batch_size"], seed=0)
    data.setup("fit")
    assert data.train_set is not None
    windows = Subset(data.train_set, range(WINDOWS))
    if spec["strategy"] == "single":
        # Under several processes Lightning always shuffles training data, with a DistributedSampler seeded by the
        # global seed; its global batch k is this permutation's k-th slice, whatever the number of replicas.
        order = torch.randperm(WINDOWS, generator=torch.Generator().manual_seed(0)).tolist()
        loader = DataLoader(windows, batch_size=spec["batch_size"], sampler=order)
    else:
        loader = DataLoader(windows, batch_size=spec["batch_size"], shuffle=False)
    model = GPT(n_layer=2, n_head=2, d_model=32, block_size=BLOCK, dropout=0.0, lr=1e-3)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = quiet_trainer(
        Path(spec["out"]).parent,
        [],
        devices=spec["devices"],
        strategy=_strategy(spec),
        max_steps=spec["steps"],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, train_dataloaders=loader)
    if trainer.global_rank == 0:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        record = {"state_dict": state, "initial": initial, "global_step": trainer.global_step}
        torch.save(record, f"{spec['out']}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
