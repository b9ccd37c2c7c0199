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


def test_print_config_shows_the_strategy_and_options():
    run = ds_train(["fit", f"--config={MIRRORED}", "--print_config"], timeout=60)
    assert "strategy: ds_mirrored" in run.output
    run = ds_train(
        [
            "fit",
            f"--config={MIRRORED}",
            "--trainer.strategy=ds_lightning.strategies.MirroredStrategy",
            "--print_config",
        ],
        timeout=60,
    )
    assert "strategy: ds_lightning.strategies.MirroredStrategy" in run.output


def test_unknown_ds_name_lists_the_available_ones():
    run = ds_train(["fit", f"--config={MIRRORED}", "--trainer.strategy=ds_mirorred"], timeout=60, check=False)
    assert run.returncode != 0
    assert "Did you mean 'ds_mirrored'?" in run.output
    assert "ds_mirrored, ds_mirrored_fork, ds_mirrored_spawn" in run.output
    assert "Initializing distributed" not in run.output


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


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--trainer.strategy.bogus=1", "bogus"),
        ("--trainer.strategy.gradient_compression=zip", "zip"),
        ("--trainer.strategy.timeout=soon", "soon"),
        ("--trainer.strategy.timeout=-5", "timeout=-5"),
    ],
    ids=["unknown-option", "bad-choice", "wrong-type", "out-of-range"],
)
def test_bad_configuration_fails_before_processes_start(tmp_path, override, message):
    run = ds_train(
        [
            "fit", f"--config={MIRRORED}", *quiet_trainer_args(tmp_path),
            "--trainer.strategy=ds_lightning.strategies.MirroredStrategy", override,
        ],
        timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode != 0
    assert message in run.output, run.output[-3000:]
    assert "Initializing distributed" not in run.output


def test_more_devices_than_available_fails_at_construction(tmp_path):
    assert not torch.cuda.is_available()
    run = ds_train(
        ["fit", f"--config={MIRRORED}", *quiet_trainer_args(tmp_path), "--trainer.accelerator=cuda"],
        timeout=60,
        check=False,
    )
    assert run.returncode != 0
    assert "not available" in run.output, run.output[-3000:]
    assert "Initializing distributed" not in run.output


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_parse(config):
    run = ds_train(["fit", f"--config={config}", "--print_config"], timeout=60)
    expected = {
        "mirrored.yaml": "strategy: ds_mirrored",
        "mirrored_powersgd.yaml": "class_path: ds_lightning.strategies.MirroredStrategy",
        "parameter_server.yaml": "class_path: ds_lightning.strategies.ParameterServerStrategy",
        "pipeline.yaml": "class_path: ds_lightning.strategies.PipelineStrategy",
    }[config.name]
    assert expected in run.output
