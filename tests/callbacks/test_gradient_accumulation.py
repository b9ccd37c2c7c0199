"""GradientAccumulation: options, parity with one process on the global batch, partial windows, no_sync, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler

from ds_lightning.callbacks import GradientAccumulation
from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from tests.helpers.controls import assert_far
from tests.helpers.models import TinyData, TinyModule
from tests.helpers.runner import ds_train, example_config, quiet_trainer_args
from tests.helpers.trainers import quiet_trainer

MIRRORED = example_config("mirrored.yaml")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of steps"),
        ({"steps": 2, "global_batch_size": 64}, "exactly one of steps"),
        ({"steps": 0}, "steps=0 must be an int >= 1"),
        ({"global_batch_size": -4}, "global_batch_size=-4"),
        ({"steps": True}, "steps=True"),
        ({"steps": 2, "schedule": {-1: 4}}, "schedule key -1"),
        ({"steps": 2, "schedule": {3: 0}}, "schedule[3]=0"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        GradientAccumulation(**kwargs)


def test_schedule_changes_the_value_from_its_epoch_on():
    callback = GradientAccumulation(steps=2, schedule={3: 4, 6: 8})
    assert [callback.value_for_epoch(e) for e in (0, 2, 3, 5, 6, 9)] == [2, 2, 4, 4, 8, 8]


def _fit_tiny(callback: GradientAccumulation, tmp_path: Path, **trainer_kwargs) -> pl.Trainer:
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=1, **trainer_kwargs)
    trainer.fit(TinyModule(), TinyData(n=64, batch_size=8))
    return trainer


def test_an_unreachable_global_batch_names_the_numbers_and_the_nearest_choices(tmp_path):
    with pytest.raises(
        MisconfigurationException, match=r"global_batch_size=20\).*takes 8 samples.*Use global_batch_size=16 or 24"
    ):
        _fit_tiny(GradientAccumulation(global_batch_size=20), tmp_path)


def test_a_trainer_accumulation_flag_is_refused_as_a_conflict(tmp_path):
    with pytest.raises(MisconfigurationException, match="remove accumulate_grad_batches"):
        _fit_tiny(GradientAccumulation(steps=2), tmp_path, accumulate_grad_batches=3)


def test_one_device_global_batch_sets_the_steps_and_steps_at_window_ends(tmp_path):
    callback = GradientAccumulation(global_batch_size=24)  # batch 8: 3 micro-batches; 8 batches: 3, 3, then 2
    trainer = _fit_tiny(callback, tmp_path)
    assert trainer.global_step == 3
    assert callback.partial_windows == 1
    assert trainer.accumulate_grad_batches == 1  # handed back after fit


# --- two ranks against one process -----------------------------------------------------------------------------


def _reference_params(epochs: int, batches_per_epoch: int, micro: int, k: int, lr: float) -> dict[str, torch.Tensor]:
    """One process, the two ranks' samples in order: windows of k x 2 x micro samples, the last one cut short."""
    pl.seed_everything(0)
    model = DigitsClassifier(hidden_sizes=(32,), lr=lr, momentum=0.0)
    data = DigitsDataModule(batch_size=micro)
    data.setup("fit")
    optimizer = model.configure_optimizers()
    sampler = DistributedSampler(data.train_set, num_replicas=1, rank=0, shuffle=True, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)[: batches_per_epoch * 2 * micro]  # what limit_train_batches leaves both ranks
        window = 2 * micro * k
        for start in range(0, len(order), window):
            x, y = next(
                iter(
                    DataLoader(
                        torch.utils.data.Subset(data.train_set, order[start : start + window]), batch_size=window
                    )
                )
            )
            optimizer.zero_grad()
            model.pipeline_loss(model(x), y).backward()
            optimizer.step()
    return {k_: v.detach() for k_, v in model.state_dict().items()}


@pytest.mark.multiprocess
def test_two_ranks_reach_a_global_batch_of_64_like_one_process_including_the_partial_window(tmp_path):
    micro, epochs, batches, lr = 16, 2, 5, 0.2  # per epoch: windows of 2, 2, then 1 micro-batches
    out = tmp_path / "run"
    ds_train(
        [
            "fit",
            *MIRRORED,
            *quiet_trainer_args(tmp_path),
            f"--trainer.max_epochs={epochs}",
            f"--trainer.limit_train_batches={batches}",
            "--trainer.limit_val_batches=0",
            "--trainer.callbacks+=ds_lightning.callbacks.GradientAccumulation",
            "--trainer.callbacks.global_batch_size=64",
            "--trainer.callbacks+=tests.helpers.callbacks.SaveParams",
            f"--trainer.callbacks.path={out}",
            "--trainer.callbacks+=tests.helpers.callbacks.RecordSteps",
            f"--trainer.callbacks.path={out}",
            "--model.hidden_sizes=[32]",
            f"--model.lr={lr}",
            "--model.momentum=0.0",
            f"--data.batch_size={micro}",
        ],
        ranks=2,  # both ranks at once, forked warm: the subject is the training, not Lightning's launcher
    )
    reference = _reference_params(epochs, batches, micro, 2, lr)
    for rank in (0, 1):
        saved = torch.load(f"{out}.rank{rank}.pt", weights_only=True)
        record = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert saved["global_step"] == record["global_step"] == 3 * epochs
        assert record["accumulate_grad_batches"] == 2
        assert record["partial_windows"] == epochs
        assert record["micro_batches"] == batches * epochs
        # A counting comm hook saw one gradient synchronisation per optimizer step, none on the other micro-batches.
        assert record["sync_rounds"] == 3 * epochs
        for name, value in reference.items():
            assert_close(saved["state_dict"][name], value, atol=1e-5, rtol=1e-5)
    # Control: the accumulation off (a step per micro-batch pair) ends far from the run, beyond the 1e-5 above
    # (measured: 3e-2 away; the run is within 1.5e-8 of the reference).
    assert_far(saved["state_dict"], _reference_params(epochs, batches, micro, 1, lr), 1e-3, "training without it")
