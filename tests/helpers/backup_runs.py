"""One training run with ``BackupAndRestore`` from a JSON spec; Lightning relaunches this script for every rank.

Usage: ``python -m tests.helpers.backup_runs SPEC.json``. Every rank appends the sample ids of each batch it trains on
to ``{out}.ids.rank{r}.jsonl`` (epoch, the optimizer step the batch belongs to, ids; each run starts with a mark
naming its ``attempt``), flushed per batch so a killed run leaves its log. ``die_at_step`` kills every rank
(``os._exit``) when that optimizer step starts, as a crash would; ``kill_server_at_step`` has the chief SIGKILL
parameter server 0; ``ckpt_path`` is passed to ``fit``. A run that ends writes ``{out}.ckpt`` (consolidated by the
strategy) and ``{out}.json`` (steps, the backup it resumed from, held-out accuracy).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ds_lightning
from ds_lightning.callbacks import BackupAndRestore, GradientAccumulation, LRScaling
from tests.helpers.callbacks import RecordOptimizerState

FEATURES, CLASSES = 12, 3
DIED = 17  # the exit code of a rank killed by die_at_step

# The spec's "events": each {"at": where, "ranks": [...], "signal": name or None, "sleep": seconds, "step": n} sends
# the signal to the rank's own process at that moment and then sleeps there (a slow moment, made so from the test
# side). ``at``: "setup" (the model's setup hook: start-up, process group up), "restore" (the model's
# on_load_checkpoint, while a backup is being restored), "step" (as optimizer step ``step`` starts) or "write" (while
# the backup of step ``step`` is being written: pickling it signals and sleeps on the process that writes).
_EVENTS: list[dict[str, Any]] = []


def fire(at: str, rank: int, step: int | None = None) -> None:
    """Run the spec's events for ``at`` on ``rank`` (at optimizer step ``step`` where it matters)."""
    for event in _EVENTS:
        if event["at"] == at and rank in event.get("ranks", [0]) and event.get("step") in (None, step):
            if event.get("signal"):
                os.kill(os.getpid(), signal.Signals[event["signal"]])
            time.sleep(event.get("sleep", 0.0))


class SlowToWrite:
    """Put into a checkpoint: pickling it (the backup's write, on the process that writes) runs the "write" events."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        fire("write", self.rank, self.step)
        return collections.OrderedDict, ()  # loads as an empty dict, also with weights_only=True


_TEACHER = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1))


def make_data(n: int, seed: int = 1) -> TensorDataset:
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ _TEACHER).argmax(1))


class Net(pl.LightningModule):
    """A small MLP meeting the ds_pipeline contract (``net`` and ``pipeline_loss``), trained by every strategy."""

    def __init__(
        self,
        optimizer: str = "adam",
        lr: float = 0.01,
        dropout: float = 0.0,
        lr_step_size: int = 3,
        noise: float = 0.0,
        buffer: bool = False,
    ) -> None:
        """``dropout`` draws from torch's generator; ``noise`` scales each step's loss by draws from Python's and
        NumPy's, so every random state a backup holds changes the trained parameters. ``buffer`` adds a buffer
        (module state no parameter server holds)."""
        super().__init__()
        torch.manual_seed(0)
        self.noise = noise
        if buffer:
            self.register_buffer("marker", torch.arange(5, dtype=torch.float32))
        layers: list[nn.Module] = [nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(dropout))]
        layers += [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)]
        self.net = nn.Sequential(*layers, nn.Linear(16, CLASSES))
        self.optimizer, self.lr, self.lr_step_size = optimizer, lr, lr_step_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def setup(self, stage: str) -> None:
        fire("setup", self.global_rank)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        fire("restore", self.global_rank)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self.net(x), y)
        if self.noise:
            loss = loss * (1 + self.noise * (random.random() - 0.5)) * (1 + self.noise * (np.random.rand() - 0.5))
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=self.lr_step_size, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RecordIds(Callback):
    """Log each batch's sample ids (found by row) and die at ``die_at_step``."""

    def __init__(self, data: TensorDataset, spec: dict[str, Any]) -> None:
        self.row_ids = {tuple(row.tolist()): i for i, row in enumerate(data.tensors[0])}
        self.out, self.die_at_step, self.attempt = spec["out"], spec.get("die_at_step"), spec.get("attempt", 0)
        self.step_sleep = spec.get("step_sleep", 0.0)  # seconds per batch: room for a signal at a random moment
        self.kill_server_at_step = spec.get("kill_server_at_step")
        self.signal_at_step = spec.get("signal_at_step")  # rank 0 sends itself SIGTERM as this step starts
        self._file: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._file = open(f"{self.out}.ids.rank{trainer.global_rank}.jsonl", "a")  # noqa: SIM115 - closed at the end
        mark = {"start": trainer.global_step, "attempt": self.attempt}  # each run's lines follow its own mark
        self._file.write(json.dumps(mark) + "\n")
        Path(f"{self.out}.pid.rank{trainer.global_rank}").write_text(str(os.getpid()))  # for signals from the test

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.die_at_step:
            self._file.close()
            os._exit(DIED)
        if trainer.global_step == self.signal_at_step and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)
        if trainer.global_step == self.kill_server_at_step and trainer.is_global_zero:
            trainer.strategy.launcher.servers[0].kill()  # type: ignore[union-attr]
        fire("step", trainer.global_rank, trainer.global_step)
        time.sleep(self.step_sleep)
        ids = [self.row_ids[tuple(row.tolist())] for row in batch[0].cpu()]
        entry = {"epoch": trainer.current_epoch, "step": trainer.global_step, "ids": ids, "t": time.monotonic()}
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if trainer.training and any(e["at"] == "write" and e.get("step") == trainer.global_step for e in _EVENTS):
            checkpoint["slow_to_write"] = SlowToWrite(trainer.global_rank, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._file.close()


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    _EVENTS[:] = spec.get("events", [])
    torch.set_num_threads(1)
    pl.seed_everything(spec.get("seed", 7), verbose=False)
    out = spec["out"]
    data = make_data(spec.get("n", 96))
    callbacks: list[Callback] = [RecordIds(data, spec)]
    if spec.get("global_batch"):
        callbacks.append(GradientAccumulation(global_batch_size=spec["global_batch"]))
    if spec.get("lr_scaling"):
        callbacks.append(LRScaling(base_batch_size=spec["global_batch"] // 2))
    callbacks.append(BackupAndRestore(spec["backup_dir"], **spec.get("backup", {})))
    if spec.get("record_optimizer_state"):  # each rank's own optimizer-state bytes: shards under sharding
        callbacks.append(RecordOptimizerState(f"{out}.optimizer"))
    name = spec.get("strategy", "ds_mirrored")
    strategy: Any = name
    if name == "ds_parameter_server":
        strategy = ds_lightning.ParameterServerStrategy(**spec.get("strategy_kwargs", {}))
    elif name == "ds_pipeline":
        strategy = ds_lightning.PipelineStrategy(**spec.get("strategy_kwargs", {}))
    elif name == "ds_mirrored" and spec.get("strategy_kwargs"):
        strategy = ds_lightning.MirroredStrategy(**spec["strategy_kwargs"])
    trainer = pl.Trainer(
        accelerator=spec.get("accelerator", "cpu"),  # "cuda": tests/gpu
        devices=spec.get("devices", 2),
        strategy=strategy,
        max_epochs=spec.get("max_epochs", 2),
        max_steps=spec.get("max_steps", -1),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=callbacks,
        default_root_dir=str(Path(out).parent),
    )
    train = DataLoader(data, batch_size=spec.get("batch_size", 8), shuffle=True)
    model = Net(**spec.get("model", {}))
    trainer.fit(model, train, ckpt_path=spec.get("ckpt_path"))
    if getattr(trainer.strategy, "is_server", False):
        return
    trainer.save_checkpoint(f"{out}.ckpt")
    x, y = make_data(4000, seed=2).tensors  # held-out samples: accuracy in steps of 0.025 points
    with torch.no_grad():  # on every rank: a model fsdp2 left sharded gathers its parameters in the forward
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    if trainer.global_rank == 0:
        backup = next(c for c in trainer.callbacks if isinstance(c, BackupAndRestore))
        summary = {"global_step": trainer.global_step, "restored_from": backup.restored_from, "accuracy": accuracy}
        Path(f"{out}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])
