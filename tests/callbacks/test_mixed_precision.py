"""MixedPrecision: options, overflow skipping, scaler state in checkpoints, bf16 on digits, refused combinations."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ds_lightning.callbacks import MixedPrecision, mixed_precision
from ds_lightning.callbacks.mixed_precision import choose_auto_precision, read_cpu_flags
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


@pytest.mark.parametrize(
    ("device_type", "cuda_bf16", "flags", "expected"),
    [
        ("cuda", True, (), "bf16"),  # Ampere and later
        ("cuda", False, (), "fp16"),  # Volta, Turing: fp16 with a loss scaler
        ("cuda", False, ("amx_bf16",), "fp16"),  # the host CPU's flags do not matter for a GPU
        ("cpu", False, ("fpu", "avx2", "amx_bf16", "amx_tile"), "bf16"),  # Sapphire Rapids
        ("cpu", False, ("avx512f", "avx512_bf16"), "bf16"),  # Cooper Lake, Zen 4
        ("cpu", False, ("fpu", "avx2", "avx512f", "avx512_vnni"), "fp32"),  # AVX-512 without bf16
        ("cpu", False, ("fpu", "avx2", "fma"), "fp32"),  # the benchmark's EPYC: bf16 measured 17.6x fp32
        ("cpu", False, (), "fp32"),  # flags unknown (no /proc/cpuinfo): stay safe
        ("cpu", True, (), "fp32"),  # a GPU's bf16 says nothing about the CPU
        ("mps", False, (), "fp32"),  # no rule for the device type: fp32
    ],
)
def test_auto_decides_by_what_the_device_runs_fast(device_type, cuda_bf16, flags, expected):
    chosen, reason = choose_auto_precision(device_type, cuda_bf16=cuda_bf16, cpu_flags=flags)
    assert chosen == expected
    assert reason
    if expected == "fp32" and device_type == "cpu":
        assert "amx_bf16" in reason and "avx512_bf16" in reason  # the log line names what was looked for


def test_explicit_choices_stand_whatever_the_device():
    for device in (torch.device("cpu"), torch.device("meta")):
        assert MixedPrecision.resolve("fp16", device) == "fp16"
        assert MixedPrecision.resolve("bf16", device) == "bf16"


def test_cpu_flags_are_read_from_the_flags_line_and_missing_means_none(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\nbugs\t\t: spectre\n\n"
        "processor\t: 1\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\n"
    )
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx2", "amx_bf16", "avx512_bf16"}
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # aarch64 has no "flags" line
    assert read_cpu_flags(cpuinfo) == frozenset()
    assert read_cpu_flags(tmp_path / "missing") == frozenset()


class _AutocastProbe(TinyModule):
    """TinyModule that records the dtype of its layer's output and whether autocast was on, per training step."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, bool]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.layer(batch[0]).dtype, torch.is_autocast_enabled("cpu")))
        return super().training_step(batch, batch_idx)


@pytest.fixture
def rank_zero_lines():
    """Messages logged through Lightning's rank-zero logger (which does not propagate to pytest's caplog)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def test_auto_on_this_cpu_trains_in_what_the_decision_function_picks_for_its_flags(tmp_path, rank_zero_lines):
    expected, _ = choose_auto_precision("cpu", cpu_flags=read_cpu_flags())
    amp = MixedPrecision("auto")
    model = _AutocastProbe()
    trainer = quiet_trainer(tmp_path, [amp], max_steps=2)
    trainer.fit(model, TinyData())
    assert amp.chosen == expected
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[expected]
    assert model.seen == [(dtype, expected == "bf16")] * 2
    said_fp32 = [line for line in rank_zero_lines if "MixedPrecision('auto') trains in fp32" in line]
    assert len(said_fp32) == (expected == "fp32")


def test_auto_on_a_cpu_without_native_bf16_keeps_fp32_and_says_why_once(tmp_path, monkeypatch, rank_zero_lines):
    # Stands in for the hardware: this CPU's flags as the benchmark machine's (AMD EPYC, avx2 only).
    monkeypatch.setattr(mixed_precision, "read_cpu_flags", lambda: frozenset({"fpu", "avx2", "fma"}))
    amp = MixedPrecision("auto")
    model = _AutocastProbe()
    trainer = quiet_trainer(tmp_path, [amp], max_steps=2)
    trainer.fit(model, TinyData())
    trainer.validate(model, TinyData(), verbose=False)
    assert amp.chosen == "fp32"
    assert amp.plugin is None
    assert type(trainer.precision_plugin) is Precision  # the Trainer's own 32-bit plugin, untouched
    assert model.seen == [(torch.float32, False)] * 2
    said = [line for line in rank_zero_lines if "MixedPrecision" in line]
    assert len(said) == 1, said  # one line, not again for validate
    assert "trains in fp32" in said[0] and "amx_bf16" in said[0] and "precision='bf16'" in said[0]


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
