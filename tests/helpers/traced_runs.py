"""Runs of non-Sequential models (TiedGPT, transformers' GPT-2) for the traced-pipeline tests, one JSON spec per launch.

``python -m tests.helpers.traced_runs SPEC.json`` runs every entry of ``spec["runs"]`` in this process (one rank of a
multi-process launch, or the single-process reference); rank 0 saves the losses and final weights to ``run["out"]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import ds_lightning
from ds_lightning.demos import TiedGPT

BLOCK = 16


def make_model(kind: str, **options: Any) -> pl.LightningModule:
    if kind == "tied":
        return TiedGPT(**{"n_layer": 4, "n_head": 2, "d_model": 32, "block_size": BLOCK, "lr": 1e-3, **options})
    from tests.helpers.hf_models import HFGPT2  # transformers only where the run needs it

    return HFGPT2(**{"n_layer": 4, "n_head": 2, "d_model": 32, "block_size": BLOCK, **options})


def make_loader(batch_size: int = 8, samples: int = 16) -> DataLoader:
    tokens = torch.randint(0, 256, (samples, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return DataLoader(data, batch_size=batch_size, shuffle=False, drop_last=True)


class RecordLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def strategy_of(run: dict[str, Any]) -> Any:
    if run.get("strategy") == "ds_pipeline":
        return ds_lightning.PipelineStrategy(**run.get("options", {}))
    return "auto"


def do_run(run: dict[str, Any]) -> dict[str, Any]:
    pl.seed_everything(run.get("seed", 0), verbose=False)
    model = make_model(run["model"], **run.get("model_options", {}))
    if run.get("untie"):
        # The control of the tied-weight tests: the head gets its own copy, as stages would without a summed gradient.
        model.net.head.weight = torch.nn.Parameter(model.net.token.weight.detach().clone())
    losses = RecordLosses()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=run.get("devices", 1),
        strategy=strategy_of(run),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=run["out"] + ".root",
        use_distributed_sampler=False,
        callbacks=[losses],
        **run.get("trainer", {"max_steps": 3}),
    )
    # 2 batches per epoch: a checkpoint after 2 steps is at an epoch's end, so a resume replays no batch.
    trainer.fit(model, train_dataloaders=make_loader(), ckpt_path=run.get("ckpt_path"))
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    result = {
        "losses": losses.losses,
        "final": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "balance_used": getattr(trainer.strategy, "balance_used", None),
        "global_step": trainer.global_step,
    }
    if trainer.is_global_zero:
        torch.save(result, run["out"])
    return result


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        do_run(run)


if __name__ == "__main__":
    main(sys.argv[1])
