"""Run a list of pipeline trainings in one set of processes (Lightning relaunches this script per rank).

Usage: ``python -m tests.helpers.pipeline_runs SPEC.json``. Each run in the spec names a strategy ("ds_pipeline",
"ds_mirrored" or "single"), its options, trainer options and an output file; rank 0 writes the initial and final
state dicts, the per-step losses, the checkpoint it made and what the strategy chose.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ds_lightning
from tests.helpers.pipeline_probes import RecordPipeline

FEATURES, CLASSES = 16, 4


def make_net(depth: int = 8, heavy: int | None = None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(depth):
        if heavy is not None and i == heavy:
            layers += [
                nn.Sequential(nn.Linear(FEATURES, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Linear(1024, FEATURES))
            ]
        else:
            layers.append(nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh()))
    layers.append(nn.Linear(FEATURES, CLASSES))
    return nn.Sequential(*layers)


def make_data(n: int = 128) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(x, y)


class PipeMLP(pl.LightningModule):
    """Follows the ds_pipeline contract: ``self.net`` and ``pipeline_loss``."""

    def __init__(
        self, depth: int = 8, lr: float = 0.1, momentum: float = 0.9, heavy: int | None = None, example: bool = False
    ) -> None:
        super().__init__()
        self.net = make_net(depth, heavy)
        if example:
            # Lightning's ModelSummary runs this through the model on every rank at fit start.
            self.example_input_array = torch.zeros(8, FEATURES)
        self.lr, self.momentum = lr, momentum
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = self.pipeline_loss(self.net(x), y)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> dict[str, Any]:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        # Halve the LR every 2 steps, so the parity tests also check each stage's scheduler.
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SequentialData(pl.LightningDataModule):
    """The same batches in the same order every epoch; data-parallel replicas split each batch's rows between them.

    Replica ``r`` of ``R`` reads rows ``r, r+R, ...``, so one step of all replicas covers exactly the rows of one
    single-process batch of ``R`` times the size.
    """

    def __init__(self, batch_size: int, samples: int = 128) -> None:
        super().__init__()
        self.data = make_data(samples)
        self.batch_size = batch_size

    def _loader(self) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        sampler = DistributedSampler(self.data, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


def _strategy(run: dict[str, Any]) -> Any:
    kind = run["strategy"]
    if kind == "ds_pipeline":
        return ds_lightning.PipelineStrategy(**run.get("options", {}))
    if kind == "ds_mirrored":
        return ds_lightning.MirroredStrategy(**run.get("options", {}))
    return "auto"


def do_run(run: dict[str, Any]) -> None:
    pl.seed_everything(run.get("seed", 0), verbose=False)
    model = PipeMLP(**run.get("model", {}))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    data = SequentialData(run.get("batch_size", 32), run.get("samples", 128))
    devices = run.get("devices", 1)
    options = {
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": run["out"] + ".root",
        "use_distributed_sampler": False,
        **run.get("trainer", {}),
    }
    # "probe": every rank records the schedules built and each layer's forward calls to PROBE.rank{R}.json.
    callbacks = [RecordPipeline(run["probe"])] if run.get("probe") else []
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=_strategy(run), callbacks=callbacks, **options)
    action = run.get("action", "fit")
    result: dict[str, Any] = {}
    if action == "fit":
        trainer.fit(model, datamodule=data, ckpt_path=run.get("ckpt_path"))
        if run.get("save"):
            trainer.save_checkpoint(run["save"])
    elif action == "validate":
        result["validate"] = trainer.validate(model, datamodule=data, verbose=False, ckpt_path=run.get("ckpt_path"))
    elif action == "predict":
        preds = trainer.predict(model, datamodule=data)
        result["predictions"] = torch.cat(preds)
    strategy = trainer.strategy
    if trainer.is_global_zero:
        result.update(
            initial=initial,
            final={k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            losses=model.losses,
            val_losses=model.val_losses,
            net_type=type(model.net).__name__,
            balance_used=getattr(strategy, "balance_used", None),
            global_step=trainer.global_step,
            metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
        )
        torch.save(result, run["out"])


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        do_run(run)


if __name__ == "__main__":
    main(sys.argv[1])
