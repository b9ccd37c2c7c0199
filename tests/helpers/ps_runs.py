"""One ds_parameter_server (or single-process reference) training from a JSON spec; Lightning relaunches this script
for every worker and server.

Usage: ``python -m tests.helpers.ps_runs SPEC.json``. Every worker writes ``{out}.rank{r}.json`` (its losses, what each
pull said, its step count); rank 0 also writes ``{out}.pt`` (final state dict) and the logged metrics.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ds_lightning
from ds_lightning.callbacks import GradientAccumulation, MixedPrecision

FEATURES, CLASSES = 16, 4


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ w).argmax(1))


class Net(pl.LightningModule):
    def __init__(
        self,
        optimizer: str = "sgd",
        scheduler: str | None = None,
        lr: float = 0.1,
        hidden: int = 32,
        inf_at_step: int | None = None,
        linear_loss: bool = False,
        momentum: float = 0.9,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES))
        self.optimizer, self.scheduler, self.lr, self.momentum = optimizer, scheduler, lr, momentum
        self.inf_at_step = inf_at_step  # the loss of this optimizer step is multiplied by inf: its gradients overflow
        self.linear_loss = linear_loss  # the loss is the sum of the parameters: every gradient entry is exactly 1
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.linear_loss:
            loss = sum(p.sum() for p in self.parameters()) + 0 * loss
        self.losses.append(float(loss))
        self.log("train_loss", loss)
        return loss * float("inf") if self.trainer.global_step == self.inf_at_step else loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)
        self.log("rank_mean", float(self.global_rank), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("test_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("test_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        if self.scheduler == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.scheduler == "epoch":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        return opt


class Record(Callback):
    """Each worker's view: the server's clocks when it was let through, and how far it got."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.pulls: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        rank, step = trainer.global_rank, trainer.global_step
        slow = self.spec.get("slow")
        if slow and rank == slow["rank"]:
            time.sleep(slow["delay"])
        kill = self.spec.get("kill_worker")
        if kill and rank == kill["rank"] and step == kill["step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        kill_server = self.spec.get("kill_server")
        if kill_server and rank == 0 and step == kill_server["step"] and trainer.current_epoch == kill_server["epoch"]:
            trainer.strategy.launcher.servers[0].kill()
        stop = self.spec.get("stop_worker")
        if stop and rank == stop["rank"] and step >= stop["step"]:
            trainer.should_stop = True

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        slow = self.spec.get("slow_push")
        if slow and trainer.global_rank == slow["rank"]:
            time.sleep(slow["delay"])  # after this step's pull, before its push

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        late = self.spec.get("late_worker")
        if late and trainer.global_rank == late["rank"]:
            time.sleep(late["seconds"])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        step = getattr(trainer.strategy, "_step", None)
        pull = step.last_pull if step is not None else None
        if pull is not None:
            self.pulls.append(
                {
                    "step": trainer.global_step,
                    "clocks": pull.clocks,
                    "updates": pull.updates,
                    "staleness_max": pull.staleness_max,
                }
            )


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("crash_server") and os.environ.get("DS_PS_SERVER") is not None:
        raise SystemExit("this server fails before trainer.fit, on purpose")
    torch.set_num_threads(1)
    out = Path(spec["out"])
    single = spec["strategy"] == "single"
    data = make_data(spec.get("n", 128))
    batch = spec.get("batch_size", 8) * (spec.get("devices", 2) if single else 1)
    callbacks: list[Callback] = [record := Record(spec)]
    if spec.get("accumulate"):
        callbacks.append(GradientAccumulation(steps=spec["accumulate"]))
    if spec.get("amp"):
        callbacks.append(MixedPrecision(**spec["amp"]))
    if spec.get("ckpt_dir"):
        callbacks.append(ModelCheckpoint(dirpath=spec["ckpt_dir"], save_top_k=-1, every_n_epochs=1))
    strategy: Any = "auto" if single else ds_lightning.ParameterServerStrategy(**spec.get("strategy_kwargs", {}))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if single else spec.get("devices", 2),
        strategy=strategy,
        max_epochs=spec.get("max_epochs", 2),
        max_steps=spec.get("max_steps", -1),
        limit_val_batches=spec.get("limit_val_batches", 1.0),
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(spec.get("ckpt_dir")),
        logger=CSVLogger(str(out.parent), name=out.name) if spec.get("csv") else False,
        log_every_n_steps=1,
        callbacks=callbacks,
        default_root_dir=str(out.parent),
        use_distributed_sampler=False,
    )
    # Worker r takes samples r, r + world, ...: step t of all workers together is the reference's batch t.
    serving = getattr(trainer.strategy, "is_server", False)
    sampler = None if single or serving else DistributedSampler(data, trainer.world_size, trainer.global_rank, False)
    train = DataLoader(data, batch_size=batch, sampler=sampler)
    val = DataLoader(data, batch_size=32, sampler=sampler)
    model = Net(**spec.get("model", {}))
    trainer.fit(model, train, val, ckpt_path=spec.get("ckpt_path"))
    rank = trainer.global_rank
    result = {
        "losses": model.losses,
        "pulls": record.pulls,
        "global_step": trainer.global_step,
        "param_sum": float(sum(p.detach().double().sum() for p in model.parameters())),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}.pt")
    if spec.get("evaluate"):
        # After fit, on the workers only (the servers ended with it): validate, test and predict in the same script.
        evaluated = {
            "validate": trainer.validate(model, val, verbose=False)[0],
            "test": trainer.test(model, val, verbose=False)[0],
        }
        predictions = trainer.predict(model, val)
        assert predictions is not None
        torch.save(torch.cat(predictions), f"{out}.predictions.rank{rank}.pt")  # type: ignore[arg-type]
        Path(f"{out}.evaluated.rank{rank}.json").write_text(json.dumps(evaluated))


if __name__ == "__main__":
    main(sys.argv[1])
