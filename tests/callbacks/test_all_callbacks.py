"""All four callbacks together from one YAML under ds_mirrored: they compose and the model still learns."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from ds_lightning.callbacks import GradientAccumulation, LRScaling, MixedPrecision
from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from ds_lightning.strategies import LayerSplitStrategy
from tests.helpers.callbacks import RecordSteps
from tests.helpers.runner import ds_train, example_config, quiet_trainer_args
from tests.helpers.trainers import quiet_trainer


@pytest.mark.multiprocess
def test_the_callbacks_example_trains_with_all_four_live(tmp_path):
    """Also the check that bf16 autocast on CPU trains the digits to accuracy: the example uses bf16."""
    report, out = tmp_path / "report.json", tmp_path / "steps"
    ds_train(
        [
            "fit",
            *example_config("callbacks.yaml"),
            *quiet_trainer_args(tmp_path),
            "--trainer.callbacks+=ds_lightning.demos.TrainingReport",
            f"--trainer.callbacks.output_json={report}",
            "--trainer.callbacks+=tests.helpers.callbacks.RecordSteps",
            f"--trainer.callbacks.path={out}",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path / 'logs'}",
            "--trainer.log_every_n_steps=1",
        ]
    )
    assert json.loads(report.read_text())["val_acc"] >= 0.9
    records = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        assert record["accumulate_grad_batches"] == 2  # 128 / the balancer's 64
        # The LR the optimizer applied: 0.05 x sqrt(128 / 32), warmed up over 10 steps from 0.1 of it.
        first_step_lr, last_lr = record["lrs"][0][1], record["lrs"][-1][1]
        assert abs(first_step_lr - 0.01) < 1e-9 and abs(last_lr - 0.1) < 1e-9
    totals = [a + b for a, b in zip(records[0]["batch_sizes"], records[1]["batch_sizes"], strict=True)]
    assert max(totals) == 64  # the balancer sized every micro-batch from its global batch
    # What the callbacks log: the effective batch (2 micro-steps of the balancer's 64), the factor and the applied LR.
    rows = list(csv.DictReader(next((tmp_path / "logs").rglob("metrics.csv")).open()))
    scaling = [r for r in rows if r.get("lr_scaling/lr")]
    assert scaling and {float(r["lr_scaling/effective_batch_size"]) for r in scaling} == {128.0}
    assert {float(r["lr_scaling/factor"]) for r in scaling} == {2.0}
    assert any(r.get("balance/share_rank0") for r in rows)


def test_accumulation_mixed_precision_and_lr_scaling_run_under_ds_model_parallel(tmp_path):
    out = tmp_path / "steps"
    amp = MixedPrecision("bf16")
    callbacks = [GradientAccumulation(steps=2), amp, LRScaling(base_batch_size=4), RecordSteps(str(out))]
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=2)
    trainer = quiet_trainer(tmp_path, callbacks, strategy=strategy, max_steps=2, limit_val_batches=0)
    trainer.fit(DigitsClassifier(hidden_sizes=(32,), lr=0.05), DigitsDataModule(batch_size=8))
    record = json.loads(Path(f"{out}.rank0.json").read_text())
    assert record["global_step"] == 2 and record["micro_batches"] == 4
    assert [round(lr, 9) for _, lr in record["lrs"]] == [0.2, 0.2]  # 0.05 x (8 x 1 process x 2) / 4
    assert trainer.precision_plugin is amp.plugin and amp.chosen == "bf16"
