"""Plain ds_mirrored and its fsdp2 engine side by side under mixed precision, manual optimization and two optimizers.

Usage: ``python -m tests.helpers.fsdp2_compose OUT SUITE``, started once per rank (``tests.helpers.runner.run_ranks``);
one launch fits every arm of ``SUITE`` in turn, plain then fsdp2, on the same process group:

- ``precision``: automatic optimization under Adam, in ``Trainer(precision="bf16-mixed")``, in ``"bf16-true"``
  (bf16 parameters, gradients and reductions), and under :class:`~ds_lightning.callbacks.MixedPrecision` ``("fp16")``
  with a loss scale big enough to overflow the first steps, and gradient clipping by norm after unscaling;
- ``manual``: two optimizers over disjoint layers under manual optimization (:func:`two_optimizers`), 2 epochs with a
  checkpoint per epoch, then a second fit resumed from the epoch-0 checkpoint.

Each arm writes ``OUT/<arm>.rank{R}.pt`` (:class:`~tests.helpers.callbacks.SaveParams`) and ``OUT/<arm>.rank{R}.json``
(what :class:`Record` saw); ``manual`` arms write checkpoints to ``OUT/<arm>/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ds_lightning.callbacks import MixedPrecision
from ds_lightning.sharding import optimizer_state_bytes
from ds_lightning.strategies import MirroredStrategy
from tests.helpers.callbacks import SaveParams
from tests.helpers.models import TwoLayers, TwoOptimizers

ENGINES = ("plain", "fsdp2")
SIZES = (16, 32, 4)  # every tensor has an even number of rows: each of 2 ranks holds half
SAMPLES, BATCH = 256, 8  # 16 steps per epoch on each of 2 ranks, 32 on one device
FP16_INIT_SCALE = 2.0**24  # overflows fp16 gradients for the first few steps, so the scaler skips and backs off


def data() -> DataLoader:
    """Four classes from the signs of two features: the same batches in every arm and on every rank."""
    x = torch.randn(SAMPLES, 16, generator=torch.Generator().manual_seed(1))
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def classifier() -> TwoLayers:
    """A 16-32-4 MLP under Adam (automatic optimization)."""
    return TwoLayers(SIZES)


def two_optimizers() -> TwoOptimizers:
    """The same MLP, Adam on its first layer and SGD on its second, under manual optimization."""
    return TwoOptimizers(SIZES)


class Record(Callback):
    """Every rank writes, at the end of fit, the precision plugin, the logits' dtype, the optimizers' classes and state
    bytes, and the loss scaler's figures as JSON to ``{path}.rank{R}.json``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.strategy.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        record = {
            "precision": str(trainer.precision),
            "logits_dtype": pl_module.logits_dtype,
            "optimizers": [type(o).__name__ for o in trainer.optimizers],
            "state_bytes": [optimizer_state_bytes(o) for o in trainer.optimizers],  # this rank's (shards under fsdp2)
            "fully_sharded": type(pl_module).__name__.startswith("FSDP"),
            "loss_scale": float(scaler.get_scale()) if scaler is not None else None,
            "skipped_steps": getattr(plugin, "skipped_steps", None),
        }
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def fit(
    out: Path, arm: str, engine: str, model: pl.LightningModule, callbacks: list[Callback], **trainer: Any
) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    sharding = {"shard_optimizer_state": True, "sharding_engine": "fsdp2"} if engine == "fsdp2" else {}
    ckpt_path = trainer.pop("ckpt_path", None)
    run = pl.Trainer(
        accelerator="cpu", devices=2, strategy=MirroredStrategy(**sharding), logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out / arm,
        callbacks=[*callbacks, SaveParams(str(out / arm)), Record(out / arm)], **trainer,
    )  # fmt: skip
    run.fit(model, data(), ckpt_path=ckpt_path)
    return run


def precision_suite(out: Path) -> None:
    for engine in ENGINES:
        for precision in ("bf16-mixed", "bf16-true"):
            fit(out, f"{precision}-{engine}", engine, classifier(), [], precision=precision, max_epochs=1,
                enable_checkpointing=False)  # fmt: skip
        fp16 = MixedPrecision("fp16", init_scale=FP16_INIT_SCALE, growth_interval=1000)
        fit(out, f"fp16-{engine}", engine, classifier(), [fp16], max_epochs=2, enable_checkpointing=False,
            gradient_clip_val=0.5)  # fmt: skip


def manual_suite(out: Path) -> None:
    for engine in ENGINES:
        arm = f"manual-{engine}"
        every_epoch = ModelCheckpoint(dirpath=out / arm, save_top_k=-1)
        fit(out, arm, engine, two_optimizers(), [every_epoch], max_epochs=2)
        (first,) = (out / arm).glob("epoch=0-*.ckpt")
        fit(out, f"{arm}-resumed", engine, two_optimizers(), [], max_epochs=2, ckpt_path=first,
            enable_checkpointing=False)  # fmt: skip


def main(out: str, suite: str) -> None:
    torch.set_num_threads(1)
    Path(out).mkdir(parents=True, exist_ok=True)
    {"precision": precision_suite, "manual": manual_suite}[suite](Path(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
