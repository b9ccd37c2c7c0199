"""MixedPrecision: options, overflow skipping, scaler state in checkpoints, bf16 on digits, refused combinations."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ds_lightning.callbacks import MixedPrecision
from tests.helpers.models import OverflowingModule, TinyData, TinyModule
from tests.helpers.trainers import quiet_trainer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp8"}, "precision='fp8'"),
        ({"init_scale": 0}, "init_scale=0"),
        ({"growth_factor": 1.0}, "growth_factor=1.0"),
        ({"backoff_factor": 1.0}, "backoff_factor=1.0"),
        ({"growth_interval": 0}, "growth_interval=0"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MixedPrecision(**kwargs)


def test_auto_picks_bf16_on_cpu_and_explicit_choices_stand():
    cpu = torch.device("cpu")
    assert MixedPrecision.resolve("auto", cpu) == "bf16"
    assert MixedPrecision.resolve("fp16", cpu) == "fp16"
    assert MixedPrecision.resolve("bf16", cpu) == "bf16"


class _Snapshots(Callback):
    """Parameters before and after every optimizer step, and the loss scale at train start."""

    def __init__(self) -> None:
        self.before: list[dict[str, torch.Tensor]] = []
        self.after: list[dict[str, torch.Tensor]] = []
        self.scale_at_start: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scale_at_start = scaler.get_scale() if scaler is not None else None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.before.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})


def test_fp16_overflow_skips_that_step_counts_it_backs_off_and_keeps_parameters_finite(tmp_path):
    amp = MixedPrecision("fp16", init_scale=1024.0, growth_interval=1000)
    snapshots = _Snapshots()
    logger = CSVLogger(tmp_path / "logs")
    trainer = quiet_trainer(tmp_path, [amp, snapshots], max_steps=5, logger=logger, log_every_n_steps=1)
    trainer.fit(OverflowingModule(inf_at_step=2), TinyData(n=64, batch_size=8))
    assert amp.chosen == "fp16"
    assert amp.skipped_steps == 1
    assert trainer.precision_plugin is amp.plugin  # still installed, so a checkpoint saved after fit has the scaler
    for index, (before, after) in enumerate(zip(snapshots.before, snapshots.after, strict=True)):
        for name in before:
            assert torch.isfinite(after[name]).all(), (index, name)
            assert after[name].dtype == torch.float32
            moved = not torch.equal(before[name], after[name])
            assert moved == (index != 2), (index, name)  # only the overflowing step left parameters alone
    assert amp.state_dict()["skipped_steps"] == 1
    lines = Path(logger.log_dir, "metrics.csv").read_text().splitlines()
    rows = [r for r in csv.DictReader(lines) if r.get("precision/loss_scale")]
    # Logged after every step: the third step overflows, so from there the scale is halved and one step skipped.
    assert [float(r["precision/loss_scale"]) for r in rows] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert [float(r["precision/skipped_steps"]) for r in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_scaler_state_and_skip_count_round_trip_through_a_checkpoint(tmp_path):
    amp = MixedPrecision("fp16", init_scale=8.0, growth_interval=1)  # the scale doubles every clean step
    first = quiet_trainer(tmp_path, [amp], max_steps=4)
    first.fit(OverflowingModule(inf_at_step=1), TinyData(n=64, batch_size=8))
    path = tmp_path / "amp.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    saved_scale = float(checkpoint["MixedPrecision"]["scale"])
    assert saved_scale == 8.0 * 2 * 0.5 * 2 * 2  # grow, back off at step 1, grow, grow
    amp_again = MixedPrecision("fp16", init_scale=8.0, growth_interval=1)
    snapshots = _Snapshots()
    second = quiet_trainer(tmp_path, [amp_again, snapshots], max_steps=5)
    second.fit(OverflowingModule(inf_at_step=99), TinyData(n=64, batch_size=8), ckpt_path=path)
    assert snapshots.scale_at_start == saved_scale
    assert amp_again.skipped_steps == 1  # carried over from the first run


def test_a_trainer_precision_flag_is_refused_as_a_conflict(tmp_path):
    trainer = quiet_trainer(tmp_path, [MixedPrecision("bf16")], max_steps=1, precision="bf16-mixed")
    with pytest.raises(MisconfigurationException, match="remove `precision=` from the Trainer"):
        trainer.fit(TinyModule(), TinyData())


def test_ds_pipeline_refuses_mixed_precision_with_the_reason():
    # A real Trainer for two stages: building it starts no process; the refusal comes from the callback's setup.
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ds_pipeline", logger=False)
    with pytest.raises(MisconfigurationException, match="MixedPrecision cannot run under ds_pipeline"):
        MixedPrecision().setup(trainer, TinyModule(), "fit")
