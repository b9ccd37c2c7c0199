"""LRScaling: options, the formula after setup and during warmup with a scheduler, resume without double scaling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ds_lightning.callbacks import LRScaling
from tests.helpers.models import TinyModule
from tests.helpers.runner import ds_train, example_config, quiet_trainer_args

MIRRORED = example_config("mirrored.yaml")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_batch_size": 0}, "base_batch_size=0"),
        ({"base_batch_size": 32, "rule": "cubic"}, "rule='cubic'"),
        ({"base_batch_size": 32, "warmup_steps": -1}, "warmup_steps=-1"),
        ({"base_batch_size": 32, "warmup_start_factor": 0.0}, "warmup_start_factor=0.0"),
        ({"base_batch_size": 32, "warmup_start_factor": 1.5}, "warmup_start_factor=1.5"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LRScaling(**kwargs)


def test_rules_and_warmup_follow_their_formulas():
    linear = LRScaling(base_batch_size=32, warmup_steps=4, warmup_start_factor=0.2)
    assert linear.factor_for(128) == 4.0
    assert LRScaling(base_batch_size=32, rule="sqrt").factor_for(128) == 2.0
    assert [linear.warmup_factor(t) for t in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert LRScaling(base_batch_size=32).warmup_factor(0) == 1.0


BASE_LR, STEP_SIZE, WARMUP, START = 0.05, 3, 4, 0.25


def _expected_lr(step: int, factor: float) -> float:
    warm = START + (1 - START) * step / WARMUP if step < WARMUP else 1.0
    return BASE_LR * factor * 0.5 ** (step // STEP_SIZE) * warm


def _args(tmp_path: Path, out: Path, devices: int, max_steps: int) -> list[str]:
    return [
        "fit",
        *MIRRORED,
        *quiet_trainer_args(tmp_path),
        f"--trainer.devices={devices}",
        f"--trainer.max_steps={max_steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks+=ds_lightning.callbacks.LRScaling",
        "--trainer.callbacks.base_batch_size=8",
        f"--trainer.callbacks.warmup_steps={WARMUP}",
        f"--trainer.callbacks.warmup_start_factor={START}",
        "--trainer.callbacks+=tests.helpers.callbacks.RecordSteps",
        f"--trainer.callbacks.path={out}",
        "--model=tests.helpers.models.DigitsWithStepLR",
        f"--model.lr={BASE_LR}",
        f"--model.lr_step_size={STEP_SIZE}",
        "--data.batch_size=16",
    ]


@pytest.mark.multiprocess
def test_lr_follows_the_formula_with_warmup_and_a_scheduler_and_resume_rescales_only_the_change(tmp_path):
    first = tmp_path / "first"
    ds_train(_args(tmp_path, first, devices=2, max_steps=5), ranks=2)
    for rank in (0, 1):
        record = json.loads(Path(f"{first}.rank{rank}.json").read_text())
        assert [step for step, _ in record["lrs"]] == list(range(5))
        for step, lr in record["lrs"]:  # effective batch 2 x 16 over base 8: x4
            assert math.isclose(lr, _expected_lr(step, 4.0), rel_tol=1e-9), (step, lr)

    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))
    second = tmp_path / "second"
    ds_train([*_args(tmp_path, second, devices=1, max_steps=8), f"--ckpt_path={checkpoint}"])
    record = json.loads(Path(f"{second}.rank0.json").read_text())
    assert [step for step, _ in record["lrs"]] == [5, 6, 7]
    for step, lr in record["lrs"]:  # one device now: x2, not x4 again on top of the restored x4
        assert math.isclose(lr, _expected_lr(step, 2.0), rel_tol=1e-9), (step, lr)


def test_parameter_server_refuses_lr_scaling_with_the_reason():
    # A real Trainer for two workers: building it starts no process; the refusal comes from the callback's setup.
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ds_parameter_server", logger=False)
    with pytest.raises(MisconfigurationException, match="LRScaling cannot run under ds_parameter_server: the servers"):
        LRScaling(base_batch_size=8).setup(trainer, TinyModule(), "fit")
