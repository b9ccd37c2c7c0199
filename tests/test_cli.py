"""``ds-train``: subcommands, the three ways to select a strategy, user classes by path, early errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DistributedSampler

from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from tests.helpers.runner import CONFIGS, REPO, ds_train, example_config, quiet_trainer_args, worker_env

MIRRORED = example_config("mirrored.yaml")
DS_TRAIN = str(Path(sys.executable).with_name("ds-train"))


def _record_args(record: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.callbacks.RecordStrategy", f"--trainer.callbacks.path={record}"]


@pytest.mark.multiprocess
def test_console_script_with_class_path_on_the_command_line(tmp_path):
    record = tmp_path / "record.json"
    args = [
        DS_TRAIN, "fit", *MIRRORED, *quiet_trainer_args(tmp_path), "--trainer.max_steps=2",
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
        sys.executable, "-m", "tests.helpers.plain_cli", "fit", *MIRRORED, f"--config={config}",
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


def _independent_outputs(checkpoint: Path) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The checkpoint's weights in a plain torch MLP on the validation split, in the order two ranks read it.

    Returns the dataset index of each evaluated sample (DistributedSampler pads 359 samples to 360 by repeating
    the first), their logits and their labels.
    """
    weights = torch.load(checkpoint, weights_only=True)["state_dict"]
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))  # mirrored.yaml's hidden_sizes [128]
    net.load_state_dict({k.removeprefix("net."): v for k, v in weights.items() if k.startswith("net.")})
    data = DigitsDataModule()
    data.setup("validate")
    val_set = data.val_set
    indices = [i for r in range(2) for i in DistributedSampler(val_set, num_replicas=2, rank=r, shuffle=False)]
    x, y = val_set.tensors
    with torch.no_grad():
        return indices, net(x[indices]), y[indices]


@pytest.mark.multiprocess
@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_evaluation_subcommands_report_the_metrics_of_the_checkpoint(tmp_path, digits_checkpoint, subcommand):
    record = tmp_path / "metrics.json"
    run = ds_train(
        [
            subcommand, *MIRRORED, f"--ckpt_path={digits_checkpoint}", *quiet_trainer_args(tmp_path),
            "--trainer.callbacks+=tests.helpers.callbacks.RecordMetrics", f"--trainer.callbacks.path={record}",
        ]
    )  # fmt: skip
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in run.output
    metrics = run.json(record)
    indices, logits, labels = _independent_outputs(digits_checkpoint)
    assert len(indices) == 360 and len(set(indices)) == 359
    once = [indices.index(i) for i in sorted(set(indices))]  # the sampler's padding repeats a sample: count it once
    correct = (logits.argmax(dim=1) == labels).double()
    accuracy = correct[once].mean()
    assert 0.5 < float(accuracy) < 1.0  # trained, and not trivially perfect: the comparison means something
    # control: the padded mean (the repeated sample counted twice) is a different figure, so the check tells them apart
    assert abs(float(correct.mean() - accuracy)) > 1e-4
    if subcommand == "validate":
        assert metrics.keys() == {"val_acc", "val_loss"}, metrics
        assert_close(torch.tensor(metrics["val_acc"], dtype=torch.float64), accuracy, atol=1e-6, rtol=0)
        loss = nn.functional.cross_entropy(logits[once], labels[once])
        assert_close(torch.tensor(metrics["val_loss"]), loss, atol=1e-5, rtol=1e-5)
    else:
        assert metrics.keys() == {"test_acc"}, metrics
        assert_close(torch.tensor(metrics["test_acc"], dtype=torch.float64), accuracy, atol=1e-6, rtol=0)


@pytest.mark.multiprocess
def test_predict_subcommand_predicts_every_sample_once_as_the_checkpoint_does(tmp_path, digits_checkpoint):
    out = tmp_path / "predictions"
    run = ds_train(
        [
            "predict", *MIRRORED, f"--ckpt_path={digits_checkpoint}", *quiet_trainer_args(tmp_path),
            "--trainer.callbacks+=tests.helpers.callbacks.SavePredictions", f"--trainer.callbacks.path={out}",
        ]
    )  # fmt: skip
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in run.output
    indices, logits, _ = _independent_outputs(digits_checkpoint)
    expected = dict(zip(indices, logits.argmax(dim=1).tolist(), strict=True))
    predicted: dict[int, int] = {}
    for rank in range(2):
        saved = torch.load(f"{out}.rank{rank}.pt", weights_only=True)
        assert saved["world_size"] == 2
        # One dataloader: Lightning un-nests the predictions but keeps batch indices per dataloader.
        predictions, (batches,) = saved["predictions"], saved["batch_indices"]
        for batch, index in zip(predictions, batches, strict=True):
            assert batch.shape == (len(index),) and batch.dtype == torch.int64  # one class id per image
            assert len(index) <= 32  # mirrored.yaml's batch_size
            for i, cls in zip(index, batch.tolist(), strict=True):
                assert i not in predicted, f"sample {i} predicted twice"
                predicted[i] = cls
    assert predicted == expected  # every one of the 359 samples once, each the class the weights give


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
    "fault_tolerant.yaml": "class_path: ds_lightning.callbacks.BackupAndRestore",
    "gpt_callbacks.yaml": "class_path: ds_lightning.callbacks.GradientAccumulation",
    "gpt_mirrored.yaml": "class_path: ds_lightning.demos.GPT",
    "gpt_parameter_server.yaml": "max_staleness: 4",
    "gpt_pipeline.yaml": "class_path: ds_lightning.demos.TextDataModule",
    "mirrored.yaml": "strategy: ds_mirrored",
    "mirrored_powersgd.yaml": "class_path: ds_lightning.strategies.MirroredStrategy",
    "model_parallel.yaml": "class_path: ds_lightning.strategies.LayerSplitStrategy",
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
        "print-name": ["fit", *MIRRORED, "--print_config"],
        "print-class-path": ["fit", *MIRRORED, class_path, "--print_config"],
        "unknown-name": ["fit", *MIRRORED, "--trainer.strategy=ds_mirorred"],
        # One more CUDA device than this machine has (on a machine without CUDA: any).
        "too-many-cuda": [
            "fit",
            *MIRRORED,
            *quiet_trainer_args(root),
            "--trainer.accelerator=cuda",
            f"--trainer.devices={torch.cuda.device_count() + 1}",
        ],
    }
    for label, (override, _) in BAD_OVERRIDES.items():
        calls[label] = ["fit", *MIRRORED, *quiet_trainer_args(root), class_path, override]
    for config in sorted(CONFIGS.glob("*.yaml")):
        calls[config.name] = ["fit", f"--config={config}", "--print_config"]
    return dict(zip(calls, _cli_calls(list(calls.values())), strict=True))


@pytest.mark.multiprocess
def test_print_config_shows_the_strategy_and_options(early_exits):
    assert "strategy: ds_mirrored" in early_exits["print-name"][1]
    assert "strategy: ds_lightning.strategies.MirroredStrategy" in early_exits["print-class-path"][1]


@pytest.mark.multiprocess
def test_unknown_ds_name_lists_the_available_ones(early_exits):
    code, output = early_exits["unknown-name"]
    assert code != "0"
    assert "Did you mean 'ds_mirrored'?" in output
    assert "ds_mirrored, ds_mirrored_fork, ds_mirrored_spawn" in output
    assert "Initializing distributed" not in output


@pytest.mark.multiprocess
def test_more_devices_than_available_fails_at_construction(early_exits):
    code, output = early_exits["too-many-cuda"]
    assert code != "0"
    # Lightning's two refusals: no CUDA at all, or fewer GPUs than requested.
    reason = "only has" if torch.cuda.is_available() else "not available"
    assert reason in output, output[-3000:]
    assert "Initializing distributed" not in output


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", list(BAD_OVERRIDES))
def test_bad_configuration_fails_before_processes_start(early_exits, label):
    code, output = early_exits[label]
    assert code != "0"
    assert BAD_OVERRIDES[label][1] in output, output[-3000:]
    assert "Initializing distributed" not in output


@pytest.mark.multiprocess
def test_example_configs_parse(early_exits):
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED_CONFIGS)  # a new example needs a line
    for name, text in EXPECTED_CONFIGS.items():
        code, output = early_exits[name]
        assert code == "0", (name, output[-3000:])
        assert text in output, (name, output[-2000:])
        assert "model:" in output and "trainer:" in output
        # The same file on a laptop, a CPU box and a GPU node; the tests pin cpu and the process count.
        assert "accelerator: auto" in output and "devices: auto" in output, (name, output[-2000:])
