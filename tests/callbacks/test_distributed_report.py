"""DistributedReport: options, one process, and real 2-rank runs where a sleeping rank must be named compute-bound."""

from __future__ import annotations

import csv
import json
import logging
import time
from pathlib import Path

import pytest

from ds_lightning.callbacks import DistributedReport
from ds_lightning.callbacks._step_clock import ClockedCallback
from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from ds_lightning.diagnostics import StepTime, step_clock
from ds_lightning.strategies import LayerSplitStrategy
from tests.helpers.runner import ds_train, example_config, quiet_trainer_args
from tests.helpers.trainers import quiet_trainer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": -1}, "every_n_steps=-1"),
        ({"trace_path": ""}, "trace_path=''"),
        ({"output_dir": 3}, "output_dir=3"),
        ({"warmup_steps": 1.5}, "warmup_steps=1.5"),
        ({"tolerance": 1.0}, "tolerance=1.0"),
        ({"gather_timeout": 0}, "gather_timeout=0"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedReport(**kwargs)


class ReadsTheClock(ClockedCallback):
    """Another user of the shared clock (as DynamicLoadBalancer is): it closes steps too, and reads them."""

    def __init__(self) -> None:
        self.seen: list[StepTime] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        clock = step_clock(trainer)
        step = clock.batch_end() or clock.last
        self.seen.append(step)


def test_one_process_under_ds_model_parallel_prints_and_writes_the_report(tmp_path, caplog):
    report = DistributedReport(every_n_steps=3, trace_path=str(tmp_path / "trace.json"), output_dir=str(tmp_path))
    other = ReadsTheClock()
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=2)
    trainer = quiet_trainer(tmp_path, [other, report], strategy=strategy, max_steps=8, limit_val_batches=0)
    with caplog.at_level(logging.INFO):
        trainer.fit(DigitsClassifier(hidden_sizes=(32,)), DigitsDataModule(batch_size=8))
    assert "DistributedReport: median ms a step over 6 steps" in caplog.text
    assert report.verdict is not None and report.verdict.straggler is None
    document = json.loads((tmp_path / "report.json").read_text())
    assert document["strategy"] == "ds_model_parallel" and len(document["steps"]["0"]) == 6
    (summary,) = document["ranks"]
    assert summary["compute_ms"] > 0 and summary["step_ms"] >= summary["compute_ms"]
    assert summary["payload_sent"] == 0  # one process: no collectives during training
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    clock = step_clock(trainer)
    assert len(clock.steps) == 8 and not clock._handles  # every step once; the gradient hooks are gone after fit
    assert other.seen == clock.steps  # both callbacks read the one measurement


class SlowValidation(DigitsClassifier):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.05)
        return super().validation_step(batch, batch_idx)


def test_validation_inside_fit_is_not_counted_as_data_loading(tmp_path):
    report = DistributedReport(every_n_steps=0, output_dir=str(tmp_path), warmup_steps=0)
    trainer = quiet_trainer(tmp_path, [report], max_steps=8, val_check_interval=3, limit_val_batches=1)
    trainer.fit(SlowValidation(hidden_sizes=(8,)), DigitsDataModule(batch_size=8))
    steps = json.loads((tmp_path / "report.json").read_text())["steps"]["0"]
    assert len(steps) == 8 and max(row[1] for row in steps) < 40  # data ms: the 50 ms validations are left out


def _run(tmp_path: Path, extra: list[str], config: str = "mirrored.yaml", steps: int = 30, ranks: int = 2) -> Path:
    out = tmp_path / "report"
    ds_train(
        [
            "fit",
            *example_config(config),
            *quiet_trainer_args(tmp_path),
            f"--trainer.max_steps={steps}",
            "--trainer.limit_val_batches=0",
            "--trainer.callbacks+=ds_lightning.callbacks.DistributedReport",
            "--trainer.callbacks.every_n_steps=10",
            # Both tests judge at the same tolerance: half a step. The 2 cores here are shared with other tests, and
            # a rank that shares its core runs measurably slower (seen: +29% of a step in data loading, no sleep).
            "--trainer.callbacks.tolerance=0.5",
            f"--trainer.callbacks.output_dir={out}",
            f"--trainer.callbacks.trace_path={out / 'trace.json'}",
            *extra,
        ],
        ranks=ranks,
    )
    return out


@pytest.mark.multiprocess
def test_a_rank_sleeping_in_training_step_is_named_compute_bound(tmp_path):
    out = _run(
        tmp_path,
        [
            "--model=tests.helpers.models.SlowRankDigits",
            "--model.hidden_sizes=[32]",
            "--model.slow_rank=1",
            "--model.delay_ms=1.0",  # 32 ms a step on rank 1 (32 samples): clear of a shared machine's jitter
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path / 'logs'}",
            "--trainer.log_every_n_steps=1",
        ],
    )
    document = json.loads((out / "report.json").read_text())
    assert document["verdict"]["straggler"] == 1 and document["verdict"]["bound"] == "compute-bound", document
    fast, slow = document["ranks"]
    assert slow["compute_ms"] > fast["compute_ms"] + 10  # the sleep is compute
    assert fast["comm_ms"] > slow["comm_ms"] + 10  # and the fast rank waits for it at the all-reduce
    # Payload at the process group: both ranks all-reduce the same gradients, at least one 32-hidden MLP a step.
    gradient_bytes = (64 * 32 + 32 + 32 * 10 + 10) * 4
    assert fast["payload_sent"] == slow["payload_sent"] >= 28 * gradient_bytes
    assert fast["lost_records"] == 0
    # Wire bytes from the kernel's TCP counters: a 2-rank ring all-reduce puts its whole payload on the wire once,
    # plus gloo's headers; the rendezvous store's connection is not counted.
    assert fast["payload_sent"] < fast["wire_sent"] < 1.5 * fast["payload_sent"]
    assert slow["payload_sent"] < slow["wire_received"] < 1.5 * slow["payload_sent"]
    assert document["links"]["reason"].startswith("every rank is on one host")
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    rows = [
        r
        for r in csv.DictReader(next((tmp_path / "logs").rglob("metrics.csv")).open())
        if r.get("report/comm_ms_rank0")
    ]
    windows = {(r["report/compute_ms_rank0"], r["report/compute_ms_rank1"]) for r in rows}  # a value stays logged
    assert len(windows) == 2 and all(float(slow) > float(fast) + 10 for fast, slow in windows)  # steps 2-11, 12-21


@pytest.mark.multiprocess
def test_control_without_the_sleep_names_no_compute_bound_straggler(tmp_path):
    out = _run(tmp_path, ["--model.hidden_sizes=[32]"])
    document = json.loads((out / "report.json").read_text())
    assert document["verdict"]["bound"] != "compute-bound", document["verdict"]


@pytest.mark.multiprocess
def test_under_ds_pipeline_every_stage_rank_is_reported(tmp_path):
    out = _run(
        tmp_path, ["--model.hidden_sizes=[32, 32]", "--trainer.strategy.init_args.trace_path=null"], "pipeline.yaml", 12
    )
    document = json.loads((out / "report.json").read_text())
    assert document["strategy"] == "ds_pipeline" and [r["rank"] for r in document["ranks"]] == [0, 1]
    assert all(r["steps"] == 10 and r["payload_sent"] > 0 for r in document["ranks"])  # the stages' sends
    assert {e["pid"] for e in json.loads((out / "trace.json").read_text())["traceEvents"]} == {0, 1}


@pytest.mark.multiprocess
def test_each_parameter_server_worker_writes_its_own_report(tmp_path):
    # Lightning's launcher starts the workers and the server: one launch.
    out = _run(tmp_path, ["--model.hidden_sizes=[32]"], "parameter_server.yaml", 12, ranks=1)
    for rank in (0, 1):
        document = json.loads((out / f"report_rank{rank}.json").read_text())
        assert [r["rank"] for r in document["ranks"]] == [rank] and "do not step together" in document["note"]
        # The pushes and pulls go over a gloo group the strategy calls directly, which the Flight Recorder does not
        # see (only torch.distributed's functions record): the payload holds the default group's few collectives.
        assert document["ranks"][0]["steps"] > 0 and document["ranks"][0]["payload_sent"] is not None
        assert (out / f"trace_rank{rank}.json").exists() and (out / f"report_rank{rank}.png").exists()
        # The kernel's TCP counters do see them: the pushes of every step.
        assert document["ranks"][0]["wire_sent"] > 100 * document["ranks"][0]["payload_sent"]
