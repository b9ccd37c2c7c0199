"""``ds-train``: subcommands, the three ways to select a strategy, user classes by path, early errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from tests.helpers.runner import CONFIGS, REPO, ds_train, quiet_trainer_args, worker_env

MIRRORED = str(CONFIGS / "mirrored.yaml")
DS_TRAIN = str(Path(sys.executable).with_name("ds-train"))


def _record_args(record: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.callbacks.RecordStrategy", f"--trainer.callbacks.path={record}"]


@pytest.mark.multiprocess
def test_console_script_with_class_path_on_the_command_line(tmp_path):
    record = tmp_path / "record.json"
    args = [
        DS_TRAIN, "fit", f"--config={MIRRORED}", *quiet_trainer_args(tmp_path), "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0", "--trainer.strategy=ds_lightning.strategies.MirroredStrategy",
        *_record_args(record),
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads(record.read_text())
    assert info["strategy"] == "MirroredStrategy" and info["world_size"] == 2


@pytest.mark.multiprocess
def test_yaml_class_path_works_in_plain_lightning_cli_without_import(tmp_path):
    config = tmp_path / "strategy.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: ds_lightning.strategies.MirroredStrategy\n"
        "    init_args:\n      gradient_compression: bf16\n"
    )
    record = tmp_path / "record.json"
    args = [
        sys.executable, "-m", "tests.helpers.plain_cli", "fit", f"--config={MIRRORED}", f"--config={config}",
        *quiet_trainer_args(tmp_path), "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
        "--trainer.callbacks=[]", *_record_args(record),
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads(record.read_text())
    assert info["strategy"] == "MirroredStrategy" and info["gradient_compression"] == "bf16"


@pytest.mark.multiprocess
def test_user_model_and_data_by_class_path(tmp_path):
    record = tmp_path / "record.json"
    run = ds_train(
        [
            "fit", "--model=tests.helpers.models.TinyModule", "--data=tests.helpers.models.TinyData",
            "--trainer.strategy=ds_mirrored", "--trainer.accelerator=cpu", "--trainer.devices=2",
            "--trainer.max_epochs=2", *quiet_trainer_args(tmp_path), *_record_args(record),
        ]
    )  # fmt: skip
    info = run.json(record)
    assert info["strategy"] == "MirroredStrategy" and info["world_size"] == 2


@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False, default_root_dir=root
    )
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule())
    path = root / "digits.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.mark.multiprocess
@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_evaluation_subcommands_run_distributed(tmp_path, digits_checkpoint, subcommand):
    run = ds_train(
        [subcommand, f"--config={MIRRORED}", f"--ckpt_path={digits_checkpoint}", *quiet_trainer_args(tmp_path)]
    )
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in run.output
    if subcommand == "validate":
        assert "val_acc" in run.output
    elif subcommand == "test":
        assert "test_acc" in run.output


def _cli_calls(calls: list[list[str]]) -> list[tuple[str, str]]:
    """Run ``ds-train`` command lines that end before training in one process; (exit code, output) per call."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.cli_calls", json.dumps(calls)],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
    )
    parts = ("\n" + proc.stdout).split("\n=== ")[1:]
    assert len(parts) == len(calls), proc.stdout[-4000:]
    results = []
    for part in parts:
        body, _, code = part.rpartition("--- exit ")
        results.append((code.strip(), body))
    return results


# --- command lines that end before any training process starts, run in one process -------------------------------

EXPECTED_CONFIGS = {
    "callbacks.yaml": "class_path: ds_lightning.callbacks.DynamicLoadBalancer",
    "mirrored.yaml": "strategy: ds_mirrored",
    "mirrored_powersgd.yaml": "class_path: ds_lightning.strategies.MirroredStrategy",
    "parameter_server.yaml": "class_path: ds_lightning.strategies.ParameterServerStrategy",
    "pipeline.yaml": "class_path: ds_lightning.strategies.PipelineStrategy",
}
BAD_OVERRIDES = {
    "unknown-option": ("--trainer.strategy.bogus=1", "bogus"),
    "bad-choice": ("--trainer.strategy.gradient_compression=zip", "zip"),
    "wrong-type": ("--trainer.strategy.timeout=soon", "soon"),
    "out-of-range": ("--trainer.strategy.timeout=-5", "timeout=-5"),
}


@pytest.fixture(scope="module")
def early_exits(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """(exit code, output) of every such command line, by label."""
    root = tmp_path_factory.mktemp("cli")
    class_path = "--trainer.strategy=ds_lightning.strategies.MirroredStrategy"
    calls = {
        "print-name": ["fit", f"--config={MIRRORED}", "--print_config"],
        "print-class-path": ["fit", f"--config={MIRRORED}", class_path, "--print_config"],
        "unknown-name": ["fit", f"--config={MIRRORED}", "--trainer.strategy=ds_mirorred"],
        "no-cuda": ["fit", f"--config={MIRRORED}", *quiet_trainer_args(root), "--trainer.accelerator=cuda"],
    }
    for label, (override, _) in BAD_OVERRIDES.items():
        calls[label] = ["fit", f"--config={MIRRORED}", *quiet_trainer_args(root), class_path, override]
    for config in sorted(CONFIGS.glob("*.yaml")):
        calls[config.name] = ["fit", f"--config={config}", "--print_config"]
    return dict(zip(calls, _cli_calls(list(calls.values())), strict=True))


def test_print_config_shows_the_strategy_and_options(early_exits):
    assert "strategy: ds_mirrored" in early_exits["print-name"][1]
    assert "strategy: ds_lightning.strategies.MirroredStrategy" in early_exits["print-class-path"][1]


def test_unknown_ds_name_lists_the_available_ones(early_exits):
    code, output = early_exits["unknown-name"]
    assert code != "0"
    assert "Did you mean 'ds_mirrored'?" in output
    assert "ds_mirrored, ds_mirrored_fork, ds_mirrored_spawn" in output
    assert "Initializing distributed" not in output


def test_more_devices_than_available_fails_at_construction(early_exits):
    assert not torch.cuda.is_available()
    code, output = early_exits["no-cuda"]
    assert code != "0"
    assert "not available" in output, output[-3000:]
    assert "Initializing distributed" not in output


@pytest.mark.parametrize("label", list(BAD_OVERRIDES))
def test_bad_configuration_fails_before_processes_start(early_exits, label):
    code, output = early_exits[label]
    assert code != "0"
    assert BAD_OVERRIDES[label][1] in output, output[-3000:]
    assert "Initializing distributed" not in output


def test_example_configs_parse(early_exits):
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED_CONFIGS)  # a new example needs a line
    for name, text in EXPECTED_CONFIGS.items():
        code, output = early_exits[name]
        assert code == "0", (name, output[-3000:])
        assert text in output, (name, output[-2000:])
        assert "model:" in output and "trainer:" in output
