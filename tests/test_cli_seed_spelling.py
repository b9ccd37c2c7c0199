"""``ds-train train --strategy=NAME``: the seed's spelling, in LightningCLI's terms, and the bundled demo it trains."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from ds_lightning.cli import seed_spelling
from ds_lightning.demos.quickstart import SHORT_NAMES
from tests.helpers.runner import ds_train, quiet_trainer_args


def _demo(args: list[str]) -> dict | None:
    """The demo configuration ``seed_spelling`` put in, or ``None``."""
    for flag, value in pairwise(args):
        if flag == "--config" and value.startswith("{"):
            return json.loads(value)
    return None


@pytest.mark.parametrize("short", list(SHORT_NAMES))
def test_train_is_fit_and_a_short_name_is_the_registered_one(short: str):
    args = seed_spelling(["train", f"--strategy={short}", "--config", "mine.yaml"])
    assert args == ["fit", "--config", "mine.yaml", f"--trainer.strategy=ds_{short}"]


def test_strategy_works_after_fit_in_either_form_and_wins_over_the_config():
    # Last on the line: jsonargparse applies options in order, so it overrides the config's strategy.
    assert seed_spelling(["fit", "-c", "a.yaml", "--strategy", "pipeline", "--trainer.max_epochs=1"]) == [
        "fit", "-c", "a.yaml", "--trainer.max_epochs=1", "--trainer.strategy=ds_pipeline",
    ]  # fmt: skip
    assert seed_spelling(["--strategy=parameter_server", "fit", "--config=a.yaml"])[-1] == (
        "--trainer.strategy=ds_parameter_server"
    )


def test_registered_names_and_class_paths_pass_through():
    assert seed_spelling(["fit", "-c", "a.yaml", "--strategy=ddp"])[-1] == "--trainer.strategy=ddp"
    assert seed_spelling(["fit", "-c", "a.yaml", "--strategy=ds_mirrored_spawn"])[-1] == (
        "--trainer.strategy=ds_mirrored_spawn"
    )
    path = "ds_lightning.strategies.MirroredStrategy"
    assert seed_spelling(["fit", "-c", "a.yaml", f"--strategy={path}"])[-1] == f"--trainer.strategy={path}"


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="Did you mean 'mirrored'") as err:
        seed_spelling(["train", "--strategy=mirored"])
    assert "Choices: mirrored, parameter_server, pipeline, model_parallel" in str(err.value)
    with pytest.raises(ValueError, match="needs a name"):
        seed_spelling(["train", "--strategy"])


def test_no_model_data_or_config_trains_the_demo_under_the_named_strategy():
    args = seed_spelling(["train", "--strategy=pipeline", "--trainer.max_epochs=1", "--model.lr=0.1"])
    demo = _demo(args)
    assert demo is not None and args[:2] == ["fit", "--config"]  # first: what follows overrides it
    assert args[3:] == ["--trainer.max_epochs=1", "--model.lr=0.1", "--trainer.strategy=ds_pipeline"]
    assert demo["trainer"]["strategy"] == "ds_pipeline"
    assert demo["model"]["class_path"] == "ds_lightning.demos.DigitsClassifier"
    assert demo["data"]["class_path"] == "ds_lightning.demos.DigitsDataModule"
    assert _demo(seed_spelling(["train"]))["trainer"]["strategy"] == "ds_mirrored"  # type: ignore[index]
    # Control: a model, data or config of the user's own, help, or another subcommand: no demo.
    for args in (
        ["train", "--strategy=pipeline", "--model=my.Model"],
        ["train", "--data", "my.Data"],
        ["fit", "--config=run.yaml"],
        ["train", "--help"],
        ["validate", "--strategy=mirrored"],
    ):
        assert _demo(seed_spelling(args)) is None, args


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("short", "strategy", "processes"),
    [
        ("mirrored", "MirroredStrategy", 2),
        ("parameter_server", "ParameterServerStrategy", 2),
        ("pipeline", "PipelineStrategy", 2),
        ("model_parallel", "LayerSplitStrategy", 1),
    ],
)
def test_train_with_only_a_strategy_trains_the_bundled_demo(tmp_path: Path, short: str, strategy: str, processes: int):
    report = tmp_path / "report.json"
    args = [
        "train", f"--strategy={short}", *quiet_trainer_args(tmp_path), "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2", "--trainer.callbacks.warmup_steps=1",
        f"--trainer.callbacks.output_json={report}",
    ]  # fmt: skip
    run = ds_train(args, timeout=240)
    assert "training the bundled demo" in run.output
    figures = json.loads(report.read_text())
    assert figures["strategy"] == strategy and figures["world_size"] == processes
    assert figures["val_acc"] is not None
