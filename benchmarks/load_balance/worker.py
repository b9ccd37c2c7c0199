"""One load-balance launch: the spec's workload on 2 CPU processes under ds_mirrored + DynamicLoadBalancer; every rank
writes ``result.{rank}.json`` (rank 0 adds the shares, final sizes and accuracy or perplexity). README.md has the rest.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import ds_lightning
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.timing import StepTimer
from benchmarks.harness.trainer import quiet_trainer
from ds_lightning.callbacks import DynamicLoadBalancer
from ds_lightning.demos import DigitsClassifier, DigitsDataModule


class Straggler(pl.LightningModule):
    """Mixed in first: on ``slow_rank`` every ``training_step`` sleeps ``delay_per_sample`` per sample, so the
    balancer counts the sleep as compute."""

    slow_rank = 0
    delay_per_sample = 0.0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.slow_rank and self.delay_per_sample > 0:
            time.sleep(self.delay_per_sample * int(batch[0].shape[0]))
        return super().training_step(batch, batch_idx)


class SlowClassifier(Straggler, DigitsClassifier):
    pass


class WorkloadModule(pl.LightningModule):
    """A workload's net and loss (the GPT's) under AdamW."""

    def __init__(self, workload: _workloads.Workload, lr: float) -> None:
        super().__init__()
        self.net, self.loss, self.lr = workload.net, workload.loss, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


class SlowWorkload(Straggler, WorkloadModule):
    pass


def make_model(spec: dict[str, Any]) -> tuple[pl.LightningModule, Dataset, tuple[torch.Tensor, torch.Tensor], str]:
    """The module, the training set, the fixed validation batch and its figure (``"acc"`` or ``"ppl"``)."""
    model: Straggler
    if spec["workload"]["model"] == "digits":
        data = DigitsDataModule(batch_size=spec["global_batch_size"] // 2, seed=0)
        data.setup("fit")
        assert data.train_set is not None and data.val_set is not None
        model = SlowClassifier(hidden_sizes=spec["hidden"], lr=spec["lr"], momentum=0.9)
        train_set, val, metric = data.train_set, data.val_set.tensors, "acc"
    else:
        built = _workloads.build(spec["workload"], seed=spec["seed"])
        windows = [built.val_set[i] for i in range(min(spec["val_windows"], len(built.val_set)))]  # type: ignore[arg-type]
        val = (torch.stack([w[0] for w in windows]), torch.stack([w[1] for w in windows]))
        model, train_set, metric = SlowWorkload(built, spec["lr"]), built.train_set, "ppl"
    model.slow_rank, model.delay_per_sample = spec["slow_rank"], spec["delay_per_sample"]
    return model, train_set, val, metric


def evaluate(model: pl.LightningModule, val: tuple[torch.Tensor, torch.Tensor], metric: str) -> float:
    """Accuracy, or perplexity (exp of the mean token loss), of ``model`` on the validation batch."""
    x, y = val
    model.eval()
    with torch.no_grad():
        out = model(x)
        if metric == "ppl":
            return float(torch.exp(model.loss(out, y)))
        return float((out.argmax(-1) == y).float().mean())


class Clock(StepTimer):
    """The harness's step and epoch clock, plus each step's compute up to the launch of its last gradient bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.compute_ms: list[float] = []
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        end = time.perf_counter()
        # Set by ds_mirrored's gradient hook while a balancer weights gradients: the end of this rank's compute,
        # before it waits for the other rank in the all-reduce.
        launched = trainer.strategy.last_bucket_time
        self.compute_ms.append(1000 * ((launched if launched > self._start else end) - self._start))
        self.sizes.append(int(batch[0].shape[0]))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pl.seed_everything(spec["seed"], verbose=False)
    balancer = DynamicLoadBalancer(
        global_batch_size=spec["global_batch_size"], interval=spec["interval"], initial_shares=[1.0, 1.0]
    )
    clock = Clock()
    model, train_set, val, metric = make_model(spec)
    limits = {"limit_train_batches": spec["limit_train_batches"]} if spec.get("limit_train_batches") else {}
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=spec["epochs"],
        strategy=ds_lightning.MirroredStrategy(timeout=spec["dist_timeout"]),
        callbacks=[clock, balancer],
        **limits,
    )
    # The balancer rebuilds this loader around its own batch sampler; its batch size (the equal split) is unused.
    loader = DataLoader(train_set, batch_size=spec["global_batch_size"] // 2, shuffle=True)
    trainer.fit(model, train_dataloaders=loader)
    rank = trainer.global_rank
    record: dict[str, Any] = {"rank": rank, "epoch_s": clock.epoch_s, "step_ms": clock.step_ms}
    record.update(compute_ms=clock.compute_ms, local_sizes=clock.sizes)
    if rank == 0:
        plan = balancer.plan
        assert plan is not None
        sizes = [list(plan.sizes_at(i)) for i in range(balancer.batches)]
        record.update(sizes=sizes, final_sizes=list(plan.latest), estimate=plan.estimate)
        record["final_ppl" if metric == "ppl" else "final_acc"] = evaluate(model, val, metric)
    Path(spec["out_dir"], f"result.{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
