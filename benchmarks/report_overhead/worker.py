"""One report-overhead launch: the digits MLP on 2 CPU processes under ds_mirrored, with or without DistributedReport;
every rank writes ``result.{rank}.json``. README.md has the rest."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import ds_lightning
from benchmarks.harness.timing import StepTimer
from benchmarks.harness.trainer import quiet_trainer
from ds_lightning.callbacks import DistributedReport
from ds_lightning.demos import DigitsClassifier, DigitsDataModule

HOOKS = (
    "on_train_epoch_start",
    "on_validation_end",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
)


def time_hooks(callback: pl.Callback) -> list[float]:
    """Wrap ``callback``'s per-step hooks to add the seconds spent in them to the returned one-item list."""
    spent = [0.0]
    for name in HOOKS:
        hook = getattr(callback, name)

        def timed(*args: Any, _hook: Any = hook) -> Any:
            start = time.perf_counter()
            try:
                return _hook(*args)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(callback, name, timed)
    return spent


class EndClock(pl.Callback):
    """When ``on_train_end`` starts (first callback) and when ``fit`` returns: the report's end-of-fit cost."""

    def __init__(self) -> None:
        self.train_end = 0.0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_end = time.perf_counter()


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pl.seed_everything(spec["seed"], verbose=False)
    timer, end = StepTimer(warmup=spec["warmup_steps"]), EndClock()
    callbacks: list[pl.Callback] = [end, timer]
    report = None
    if spec["report"]:
        report = DistributedReport(every_n_steps=spec["every_n_steps"], output_dir=str(Path(spec["out_dir"], "report")))
        callbacks.append(report)
        spent = time_hooks(report)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        max_steps=spec["warmup_steps"] + spec["steps"],
        strategy=ds_lightning.MirroredStrategy(timeout=spec["dist_timeout"]),
        callbacks=callbacks,
    )
    model = DigitsClassifier(hidden_sizes=tuple(spec["hidden"]), lr=0.05, momentum=0.9)
    trainer.fit(model, DigitsDataModule(batch_size=spec["batch_size"], seed=0))
    done = time.perf_counter()
    spans = timer.spans[spec["warmup_steps"] :]
    record: dict[str, Any] = {"rank": trainer.global_rank, **timer.reading()}
    # Wall time per timed step, batch start to batch start: every hook of every callback, data loading included.
    record["wall_ms_per_step"] = 1000 * (spans[-1][0] - spans[0][0]) / (len(spans) - 1) if len(spans) > 1 else None
    record["end_of_fit_s"] = done - end.train_end
    if report is not None:
        steps = spec["warmup_steps"] + spec["steps"]
        record["hook_ms_per_step"] = 1000 * spent[0] / steps  # the report's own hooks, every step
    if report is not None and report.verdict is not None:
        record["verdict"] = report.verdict.bound
        record["median_step_ms_reported"] = statistics.median(s.step_ms for s in report.summaries)
    Path(spec["out_dir"], f"result.{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
