"""ds-train runs of ds_mirrored under Adam on the digits, for the optimizer-state sharding tests (zero and fsdp2).

Every run trains the same model (hidden sizes 64-64, parameters of near-equal size) on the same data and seed, with
:class:`~tests.helpers.callbacks.SaveParams`, :class:`~tests.helpers.callbacks.RecordOptimizerState` and a checkpoint
per epoch, so an engine's run compares with plain ds_mirrored's (``plain_adam_run`` in ``tests/strategies/conftest.py``,
shared by both engines' test files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.testing import assert_close

from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from tests.helpers.runner import example_config, quiet_trainer_args

MIRRORED = example_config("mirrored.yaml")
HIDDEN = "[64, 64]"  # parameters of near-equal size, so a per-parameter partition can halve the state
STEPS_PER_EPOCH = 23  # 1437 samples, 2 ranks, batches of 32


def fit_args(root: Path, out: Path, epochs: int, shard: bool, extra: list[str] = ()) -> list[str]:
    """``ds-train fit`` arguments: ``epochs`` epochs of ds_mirrored under Adam, recording into ``out`` and ``root``."""
    return [
        "fit",
        *MIRRORED,
        *quiet_trainer_args(root),
        f"--trainer.max_epochs={epochs}",
        "--trainer.limit_val_batches=0",
        "--trainer.strategy=ds_lightning.strategies.MirroredStrategy",
        f"--trainer.strategy.shard_optimizer_state={str(shard).lower()}",
        "--trainer.callbacks+=tests.helpers.callbacks.SaveParams",
        f"--trainer.callbacks.path={out}",
        "--trainer.callbacks+=tests.helpers.callbacks.RecordOptimizerState",
        f"--trainer.callbacks.path={out}",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={root / 'ckpt'}",
        "--trainer.callbacks.save_top_k=-1",  # one file per epoch
        f"--model.hidden_sizes={HIDDEN}",
        "--model.optimizer=adam",
        "--model.lr=0.01",
        *extra,
    ]


def params(out: Path, rank: int) -> dict:
    """What :class:`~tests.helpers.callbacks.SaveParams` wrote on ``rank``."""
    return torch.load(f"{out}.rank{rank}.pt", weights_only=True)


def record(out: Path, rank: int) -> dict:
    """What :class:`~tests.helpers.callbacks.RecordOptimizerState` wrote on ``rank``."""
    return json.loads(Path(f"{out}.rank{rank}.json").read_text())


def epoch_checkpoint(root: Path, epoch: int = 0) -> Path:
    """The checkpoint :func:`fit_args`' ``ModelCheckpoint`` wrote at the end of ``epoch``."""
    (path,) = (root / "ckpt").glob(f"epoch={epoch}-*.ckpt")
    return path


def assert_plain_optimizer_layouts(path: Path, reference: Path) -> list[dict[str, Any]]:
    """Each optimizer's state in ``path`` is the one in ``reference`` (a plain run's): layout and values; returns them.

    The plain layout numbers each optimizer's parameters from 0 in the order of its param groups. Both files load with
    ``weights_only=True``: tensors and plain numbers only.
    """
    states = torch.load(path, weights_only=True)["optimizer_states"]
    expected_states = torch.load(reference, weights_only=True)["optimizer_states"]
    assert len(states) == len(expected_states)
    for state, expected in zip(states, expected_states, strict=True):
        assert state["param_groups"] == expected["param_groups"]
        numbered = [index for group in expected["param_groups"] for index in group["params"]]
        assert state["state"].keys() == expected["state"].keys() == set(range(len(numbered)))
        for index, values in expected["state"].items():
            assert values.keys() == state["state"][index].keys()
            for key, value in values.items():
                assert_close(state["state"][index][key], value, atol=1e-5, rtol=1e-5)
    return states


def assert_plain_optimizer_layout(path: Path, reference: Path) -> dict[str, Any]:
    """:func:`assert_plain_optimizer_layouts` for a run with one optimizer (Adam over the 6 tensors); returns it."""
    (state,) = assert_plain_optimizer_layouts(path, reference)
    assert state["state"].keys() == set(range(6))
    return state


def resume_on_one_device(checkpoint: Path, root: Path) -> pl.Trainer:
    """A plain single-device Trainer resumes the 2-epoch run from ``checkpoint`` (written at the end of epoch 0).

    Asserts it trained the second epoch on one device (45 batches of 32) with the checkpoint's Adam state continued.
    """
    model = DigitsClassifier(hidden_sizes=(64, 64), optimizer="adam", lr=0.01)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32), ckpt_path=checkpoint)
    steps_on_one = trainer.global_step - STEPS_PER_EPOCH
    assert steps_on_one == 45  # 1437 samples in batches of 32 on one device
    adam_state = trainer.optimizers[0].state
    assert all(float(s["step"]) == STEPS_PER_EPOCH + steps_on_one for s in adam_state.values())  # not restarted
    return trainer
