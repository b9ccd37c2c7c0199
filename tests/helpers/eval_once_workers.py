"""One rank of the evaluate-each-sample-once runs: ``python -m tests.helpers.eval_once_workers STRATEGY OUT SIZE...``.

For each set size it validates, tests and predicts a fixed classifier under STRATEGY (``ds_mirrored``,
``ds_parameter_server``, ``ds_pipeline`` with two replicas of two stages, or Lightning's ``ddp`` as the control) and
writes, per rank, what was logged and which sample indices each rank saw, to ``OUT.rank<R>.json``. A size the strategy
refuses records the error instead. Then, on the last size, a validation that logs ``on_step`` with ``sync_dist`` (the
ranks run uneven batch counts there) records whether it was refused; under ``--fit`` a fit with validation runs first.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import ds_lightning

FEATURES, CLASSES, BATCH = 8, 3, 20


def make_data(size: int) -> TensorDataset:
    """Features, labels and each sample's index, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(size, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (size,), generator=g)
    return TensorDataset(x, y, torch.arange(size))


def make_net() -> nn.Sequential:
    torch.manual_seed(3)  # a fixed classifier: every rank and the reference build the same weights
    return nn.Sequential(nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh()), nn.Linear(16, CLASSES))


class FixedClassifier(pl.LightningModule):
    """Logs accuracy as a torchmetrics object and as a plain per-batch mean, and the number of samples (a sum)."""

    def __init__(self, step_sync: bool = False) -> None:
        super().__init__()
        self.net = make_net()
        self.step_sync = step_sync
        self.acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.seen: list[int] = []

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return self.pipeline_loss(self.net(x), y) * 0.0  # keeps the classifier fixed: validation sees the same one

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.0)

    def _evaluate(self, batch: Any) -> None:
        x, y, index = batch
        preds = self.net(x).argmax(-1)
        self.seen += index.tolist()
        self.acc.update(preds, y)
        self.log("acc_metric", self.acc, on_epoch=True)
        self.log("acc_mean", (preds == y).float().mean(), on_epoch=True, sync_dist=True)
        self.log("samples", float(len(y)), reduce_fx="sum", on_epoch=True, sync_dist=True)
        if self.step_sync:
            self.log("acc_step", (preds == y).float().mean(), on_step=True, on_epoch=False, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _, index = batch
        return torch.stack([index, self.net(x).argmax(-1)], dim=1)


def make_trainer(strategy_name: str, world: int, **extra: Any) -> pl.Trainer:
    strategies: dict[str, Any] = {
        "ddp": lambda: "ddp",
        "ds_mirrored": lambda: ds_lightning.MirroredStrategy(timeout=60),
        "ds_parameter_server": lambda: ds_lightning.ParameterServerStrategy(timeout=60),
        "ds_pipeline": lambda: ds_lightning.PipelineStrategy(data_parallel_size=2, timeout=60),
    }
    return pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategies[strategy_name](),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **extra,
    )


def main() -> None:
    strategy_name, out, *sizes = sys.argv[1:]
    fit = "--fit" in sizes
    sizes = [s for s in sizes if s != "--fit"]
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["LOCAL_RANK"])
    record: dict[str, Any] = {}

    def evaluate(size: int) -> dict[str, Any]:
        loader = DataLoader(make_data(size), batch_size=BATCH)
        result: dict[str, Any] = {}
        for fn in ("validate", "test", "predict"):
            model = FixedClassifier()
            trainer = make_trainer(strategy_name, world)
            try:
                output = getattr(trainer, fn)(model, dataloaders=loader)
            except Exception as error:  # the run records a refusal; the test checks its message
                result[fn] = {"error": f"{type(error).__name__}: {error}"}
                continue
            if fn == "predict":
                rows = torch.cat(output).tolist() if output else []
                result[fn] = {"indices": [r[0] for r in rows], "preds": [r[1] for r in rows]}
            else:
                result[fn] = {"metrics": {k: float(v) for k, v in output[0].items()}, "indices": model.seen}
        return result

    if fit:
        model = FixedClassifier()
        trainer = make_trainer(strategy_name, world, max_steps=1, limit_train_batches=1)
        train = DataLoader(make_data(64), batch_size=BATCH)
        trainer.fit(model, train_dataloaders=train, val_dataloaders=DataLoader(make_data(359), batch_size=BATCH))
        record["fit359"] = {
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "indices": model.seen,
        }
    for size in sizes:
        record[size] = evaluate(int(size))
    if strategy_name == "ddp":  # the control: Lightning's DDP would hang there until its 30-minute timeout
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(record))
        return
    # Last: the ranks run uneven batch counts on 361 samples, so an on_step sync would hang; it must be refused.
    model = FixedClassifier(step_sync=True)
    try:
        make_trainer(strategy_name, world).validate(model, DataLoader(make_data(361), batch_size=BATCH))
        record["step_sync"] = "ran"
    except Exception as error:
        record["step_sync"] = f"{type(error).__name__}: {error}"
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
