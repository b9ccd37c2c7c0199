"""One launch of the straggler benchmark (see README.md): the spec's workload on 2 CPU workers under ds_mirrored or
ds_parameter_server; every worker writes ``result.{r}.json`` into the spec's ``out_dir``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ds_lightning
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.timing import StepTimer
from benchmarks.harness.trainer import quiet_trainer
from ds_lightning.demos import DigitsClassifier, DigitsDataModule


def _batch_size(batch: Any) -> int:
    return int(batch[0].shape[0])


def _budget_spent(trainer: pl.Trainer) -> bool:
    """Whether this step's pull found ds_parameter_server's ``max_updates`` spent: the step ran but pushed nothing
    (nothing else here sets ``should_stop``: ds_mirrored ends at ``max_steps``)."""
    return getattr(trainer.strategy, "max_updates", None) is not None and trainer.should_stop


class _Timed:
    """Notes when ``training_step`` starts (under ds_parameter_server: after the pull)."""

    step_started = 0.0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.step_started = time.perf_counter()
        return super().training_step(batch, batch_idx)  # type: ignore[misc]


class TimedClassifier(_Timed, DigitsClassifier):
    pass


class Workload(pl.LightningModule):
    """A workload's net and loss (the GPT's) under AdamW."""

    def __init__(self, workload: _workloads.Workload, lr: float) -> None:
        super().__init__()
        self.net, self.loss, self.lr = workload.net, workload.loss, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


class TimedWorkload(_Timed, Workload):
    pass


PHASES = ("sleep", "before_step", "step_backward", "after_backward")


class StepClock(StepTimer):
    """The harness's step clock, stopped once the update budget is spent; the straggler sleeps inside the clock; each
    step splits into the sleep, up to ``training_step`` (the pull), it plus backward (ds_mirrored's all-reduce), and
    what follows (the push, or the optimizer step)."""

    def __init__(self, slow_rank: int, delay_per_sample: float) -> None:
        super().__init__()
        self.slow_rank, self.delay_per_sample = slow_rank, delay_per_sample
        self.phase_ms: dict[str, list[float]] = {name: [] for name in PHASES}
        self.samples = 0
        self._backward_done = self._slept = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        start = time.perf_counter()
        if trainer.global_rank == self.slow_rank and self.delay_per_sample > 0:
            time.sleep(self.delay_per_sample * _batch_size(batch))
        self._slept = time.perf_counter() - start if trainer.global_rank == self.slow_rank else 0.0

    def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._backward_done = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if _budget_spent(trainer):
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        started, end = pl_module.step_started, self._last_end or time.perf_counter()
        phases = (self._slept, started - self._start - self._slept, self._backward_done - started)
        for name, value in zip(PHASES, (*phases, end - self._backward_done), strict=True):
            self.phase_ms[name].append(1000 * value)
        self.samples += _batch_size(batch)


class Evaluator(Callback):
    """Rank 0 only, no collectives: every ``every`` steps, accuracy or perplexity (``metric``) of its parameters on the
    validation batch, against the samples the servers' update count (or ds_mirrored's steps) stands for."""

    def __init__(
        self, every: int, val: tuple[torch.Tensor, torch.Tensor], samples_per_update: int, metric: str = "acc"
    ):
        self.every, (self.x, self.y), self.metric, self.samples_per_update = every, val, metric, samples_per_update
        self.curve: list[list[float]] = []
        self.eval_s, self._steps = 0.0, 0

    def evaluate(self, module: Any) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = module(self.x)
            if self.metric == "ppl":
                value = float(torch.exp(module.loss(out, self.y)))
            else:
                value = float((out.argmax(-1) == self.y).float().mean())
        self.eval_s += time.perf_counter() - start
        return value

    def _samples_seen(self, trainer: pl.Trainer) -> int:
        pull = getattr(trainer.strategy, "_last_pull", None)
        return (trainer.global_step if pull is None else int(pull.updates)) * self.samples_per_update

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            self.curve.append([0, self.evaluate(pl_module)])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != 0 or _budget_spent(trainer):
            return
        self._steps += 1
        if self._steps % self.every == 0:
            self.curve.append([self._samples_seen(trainer), self.evaluate(pl_module)])


def make_model(spec: dict[str, Any]) -> tuple[pl.LightningModule, Dataset, tuple[torch.Tensor, torch.Tensor], str]:
    """The module, the training set, the fixed validation batch and its figure (``"acc"`` or ``"ppl"``)."""
    workload = spec.get("workload", {"model": "digits"})
    if workload["model"] == "digits":
        data = DigitsDataModule(batch_size=spec["batch_size"], seed=0)
        data.setup("fit")
        assert data.train_set is not None and data.val_set is not None
        model = TimedClassifier(hidden_sizes=spec["hidden"], lr=spec["lr"])
        # The epoch-level train_acc would all-gather over the workers at every epoch end (torchmetrics syncs through
        # torch.distributed, not the strategy), holding ds_parameter_server's fast worker to the slow one once per
        # epoch. Nothing here reads train_acc, so it stays local under every strategy.
        model.train_acc.sync_on_compute = False
        return model, data.train_set, data.val_set.tensors, "acc"
    built = _workloads.build(workload, seed=spec["seed"])
    windows = [built.val_set[i] for i in range(min(spec["val_windows"], len(built.val_set)))]  # type: ignore[arg-type]
    val = (torch.stack([w[0] for w in windows]), torch.stack([w[1] for w in windows]))
    return TimedWorkload(built, spec["lr"]), built.train_set, val, "ppl"


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pl.seed_everything(spec["seed"], verbose=False)
    workers, batch, steps = 2, spec["batch_size"], spec["steps"]
    if spec["strategy"] == "ds_mirrored":
        strategy: Any = ds_lightning.MirroredStrategy(timeout=spec["dist_timeout"])
        samples_per_update = workers * batch
        limits = {"max_steps": steps}
    else:
        staleness = spec["max_staleness"]
        # Equal samples: ds_mirrored runs `steps` steps on each worker. Under max_staleness=0 one server update takes
        # one batch from every worker; otherwise every push is an update of one batch.
        samples_per_update = workers * batch if staleness == 0 else batch
        budget = steps if staleness == 0 else workers * steps
        strategy = ds_lightning.ParameterServerStrategy(
            max_staleness=staleness, max_updates=budget, timeout=spec["dist_timeout"]
        )
        limits = {"max_epochs": 100_000}  # the update budget ends the run, not the epochs
    clock = StepClock(spec["slow_rank"], spec["delay_per_sample"])
    model, train_set, val, metric = make_model(spec)
    evaluator = Evaluator(spec["eval_every"], val, samples_per_update, metric)
    trainer = quiet_trainer(
        accelerator="cpu", devices=workers, strategy=strategy, callbacks=[clock, evaluator], **limits
    )
    loader = DataLoader(train_set, batch_size=batch, shuffle=True, drop_last=True)
    trainer.fit(model, train_dataloaders=loader)
    if getattr(trainer.strategy, "is_server", False):
        # A server's fit returns once every worker is done. Its interpreter shutdown takes seconds (outside anything
        # measured, but the chief's fit waits for it), so it leaves at once.
        sys.stdout.flush()
        os._exit(0)
    rank, steps_ms = trainer.global_rank, clock.step_ms
    busy_ms = [t - s for t, s in zip(steps_ms, clock.phase_ms["sleep"], strict=True)]
    record: dict[str, Any] = {
        "rank": rank,
        "steps": len(steps_ms),
        "samples": clock.samples,
        "first_start": clock.spans[0][0] if clock.spans else None,
        "last_end": clock.spans[-1][1] if clock.spans else None,
        "median_step_ms": statistics.median(steps_ms) if steps_ms else None,
        "median_busy_ms": statistics.median(busy_ms) if busy_ms else None,
        "phase_ms": {name: statistics.median(v) if v else None for name, v in clock.phase_ms.items()},
        "step_ms": steps_ms,
    }
    if rank == 0:
        # After fit the chief holds the final parameters (under ds_parameter_server, what its `done` pulled).
        record["curve"] = evaluator.curve
        record["final_ppl" if metric == "ppl" else "final_acc"] = evaluator.evaluate(model)
        record["eval_s"] = evaluator.eval_s
    out = Path(spec["out_dir"])
    (out / f".result.{rank}").write_text(json.dumps(record))
    (out / f".result.{rank}").replace(out / f"result.{rank}.json")  # whole, since rank 0 leaves once it exists
    # Leave at once: the interpreter's and Lightning's teardown measure nothing and took seconds per launch; the chief
    # waits for the other worker's result first, since the harness ends the launch's processes when the chief exits.
    deadline = time.monotonic() + spec["dist_timeout"]
    while rank == 0 and time.monotonic() < deadline and not (out / f"result.{1 - rank}.json").exists():
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
