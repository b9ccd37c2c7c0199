"""One task of a cluster-benchmark launch (``python worker.py spec.json``), its role set by ``TF_CONFIG`` only: runs
the spec's configurations in order, writing ``{name}.rank{r}.json`` after each (a server's fit never returns)."""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ds_lightning
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.timing import StepTimer
from benchmarks.harness.trainer import quiet_trainer
from benchmarks.mirrored.auto import auto_reading
from ds_lightning.callbacks import DynamicLoadBalancer
from ds_lightning.demos import DigitsClassifier, DigitsDataModule

IMPORTED = time.time()


class Clock(StepTimer):
    """The harness's clock, stopped once a server's update budget is spent; counts this task's samples, its compute
    time (up to the last gradient bucket's launch, under a balancer) and, per host, its veth's bytes."""

    def __init__(self, warmup: int, interface: str | None = None) -> None:
        super().__init__(warmup)
        # The host's link counter (read by each host's local rank 0): what crossed between hosts.
        self.tx_path = Path(f"/sys/class/net/{interface}/statistics/tx_bytes") if interface else None
        self.tx_at_warmup: int | None = None
        self.tx_last: int | None = None
        self.bytes_at_warmup: float | None = None
        self.compute_ms: list[float] = []
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # ds_parameter_server's max_updates spent at this step's pull: it ran but pushed nothing.
        if getattr(trainer.strategy, "max_updates", None) is not None and trainer.should_stop:
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        end = self._last_end or time.perf_counter()
        # Set by ds_mirrored's gradient hook while a balancer weights gradients (0 otherwise).
        launched = getattr(trainer.strategy, "last_bucket_time", 0.0)
        self.compute_ms.append(1000 * ((launched if launched > self._start else end) - self._start))
        self.sizes.append(int(batch[0].shape[0]))
        if self.tx_path is not None and trainer.local_rank == 0 and len(self.step_ms) >= self.warmup:
            self.tx_last = int(self.tx_path.read_text())
            if len(self.step_ms) == self.warmup:
                self.tx_at_warmup = self.tx_last
        if len(self.step_ms) == self.warmup and hasattr(trainer.strategy, "comm_bytes_per_step"):
            self.bytes_at_warmup = float(trainer.strategy.comm_bytes_per_step)


class GPTModule(pl.LightningModule):
    """The workload's GPT net and token loss under AdamW (betas 0.9, 0.95; weight decay 0.1), nothing logged."""

    def __init__(self, net: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]).flatten(0, -2), batch[1].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


@dataclass
class Source:
    """What every configuration of a launch trains on; the GPT's initial net is copied for each configuration."""

    train_set: Dataset
    val: tuple[torch.Tensor, torch.Tensor]
    net: torch.nn.Module | None = None  # None: the digits classifier, built from the seed


def make_source(spec: dict[str, Any]) -> Source:
    workload = spec.get("workload", {"model": "digits"})
    if workload["model"] == "digits":
        data = DigitsDataModule(batch_size=spec["batch_size"], seed=0)
        data.setup("fit")
        assert data.train_set is not None and data.val_set is not None
        return Source(data.train_set, data.val_set.tensors)
    built = _workloads.build(workload, seed=spec["seed"])
    windows = [built.val_set[i] for i in range(min(spec["val_windows"], len(built.val_set)))]  # type: ignore[arg-type]
    return Source(built.train_set, tuple(torch.stack(t) for t in zip(*windows, strict=True)), built.net)  # type: ignore[arg-type]


def _strategy(spec: dict[str, Any]) -> Any:
    if spec.get("strategy", "ds_mirrored") != "ds_mirrored":
        # Asynchronous, every push (one batch) is an update: the same samples as ds_mirrored's `steps` per worker.
        budget = spec["workers"] * spec["steps"]
        return ds_lightning.ParameterServerStrategy(
            max_staleness=None, max_updates=budget, timeout=spec["dist_timeout"]
        )
    interval = {"auto_interval": spec["auto_interval"]} if spec.get("auto_interval") is not None else {}
    return ds_lightning.MirroredStrategy(
        gradient_compression=spec.get("compression", "none"),
        powersgd_rank=spec.get("powersgd_rank", 2),
        powersgd_start_iter=spec.get("powersgd_start_iter", 10),
        hierarchical=spec.get("hierarchical", "auto"),
        timeout=spec["dist_timeout"],
        **interval,
    )


def fit_one(spec: dict[str, Any], data: Source) -> None:
    """One configuration: a fresh Trainer, strategy and model; writes ``{name}.rank{r}.json``."""
    torch.set_num_threads(1)
    pl.seed_everything(spec["seed"], verbose=False)
    kind = spec["kind"]
    clock = Clock(spec.get("warmup", 0), spec.get("interface"))
    callbacks: list[Callback] = [clock]
    balancer = None
    if kind == "balance":
        balancer = DynamicLoadBalancer(
            global_batch_size=spec["global_batch_size"], interval=spec["interval"], initial_shares=[1.0, 1.0]
        )
        callbacks.append(balancer)
        limits: dict[str, Any] = {"max_epochs": spec["epochs"]}
    elif spec.get("strategy", "ds_mirrored") == "ds_mirrored":
        limits = {"max_steps": spec["steps"] + spec.get("warmup", 0)}
    else:
        limits = {"max_epochs": 100_000}  # the update budget ends the run, not the epochs
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=spec.get("devices", 1),
        strategy=_strategy(spec),
        default_root_dir=str(Path(spec["records"]).parent),
        callbacks=callbacks,
        **limits,
    )
    loader = DataLoader(data.train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=kind != "balance")
    model: pl.LightningModule
    if data.net is None:
        model = DigitsClassifier(hidden_sizes=spec["hidden"], lr=spec["lr"], momentum=0.9)
        # The epoch-level train_acc would all-gather over the workers at every epoch end (torchmetrics syncs through
        # torch.distributed): a collective the parameter-server workers must not share. Nothing reads it here.
        model.train_acc.sync_on_compute = False
    else:
        model = GPTModule(copy.deepcopy(data.net), spec["lr"])
    fit_start = time.time()
    trainer.fit(model, train_dataloaders=loader)
    fit_end = time.time()
    rank, strategy = trainer.global_rank, trainer.strategy
    record: dict[str, Any] = {
        "name": spec["name"],
        "rank": rank,
        "fit_s": fit_end - fit_start,
        "to_first_step_s": (clock.spans[0][0] if clock.spans else fit_end) - fit_start,
        "step_ms": clock.step_ms,
        "compute_ms": clock.compute_ms,
        "local_sizes": clock.sizes,
        "epoch_s": clock.epoch_s,
        "samples": sum(clock.sizes),
        "steps": len(clock.step_ms),
        "first_start": clock.spans[0][0] if clock.spans else None,
        "last_end": clock.spans[-1][1] if clock.spans else None,
        "params": sum(p.numel() for p in model.parameters()),
        # Tells runs apart whose accuracy happens to coincide (same seed and data; only the gradients' path differs).
        "param_checksum": float(sum(p.detach().double().abs().sum() for p in model.parameters())),
        "local_rank": trainer.local_rank,
        "tx_timed_bytes": None if clock.tx_last is None else clock.tx_last - (clock.tx_at_warmup or 0),
    }
    if rank == 0 and spec.get("params_dir"):  # for the parity of two runs that differ only in the gradients' path
        torch.save(model.state_dict(), Path(spec["params_dir"], f"{spec['name']}.pt"))
    if hasattr(strategy, "comm_bytes_per_step"):
        record["uncompressed_bytes_per_step"] = float(strategy.uncompressed_bytes_per_step)
        record["comm_bytes_per_step"] = float(strategy.comm_bytes_per_step)  # mean over every step, warm-up included
        if clock.bytes_at_warmup is not None and record["steps"] > clock.warmup:
            # The timed steps' own mean (PowerSGD's first steps are plain all-reduces).
            total = record["comm_bytes_per_step"] * record["steps"]
            record["timed_bytes_per_step"] = (total - clock.bytes_at_warmup * clock.warmup) / (
                record["steps"] - clock.warmup
            )
    auto = auto_reading(strategy)  # gradient_compression="auto": its choices and the link figures it measured
    if auto is not None:
        record["auto"] = auto
    if balancer is not None and rank == 0 and balancer.plan is not None:
        record["sizes"] = [list(balancer.plan.sizes_at(i)) for i in range(balancer.batches)]
        record["final_sizes"] = list(balancer.plan.latest)
        record["estimate"] = balancer.plan.estimate
    if rank == 0:
        # After fit the chief holds the final parameters (under ds_parameter_server, the servers' last ones).
        x, y = data.val
        model.eval()
        with torch.no_grad():
            if data.net is None:
                record["final_acc"] = float((model(x).argmax(-1) == y).float().mean())
            else:  # exp of the mean token cross-entropy over every validation token
                record["final_ppl"] = math.exp(float(F.cross_entropy(model(x).flatten(0, -2), y.flatten())))
    Path(spec["records"], f"{spec['name']}.rank{rank}.json").write_text(json.dumps(record))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    common = {k: v for k, v in spec.items() if k != "configs"}
    data = make_source(spec)
    Path(spec["records"], f"started.{os.getpid()}").write_text(json.dumps({"imported_at": IMPORTED}))
    for config in spec["configs"]:  # in order; the process group stays up between fits
        fit_one({**common, **config}, data)
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
