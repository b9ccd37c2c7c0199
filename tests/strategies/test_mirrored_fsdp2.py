"""ds_mirrored with shard_optimizer_state=True, sharding_engine="fsdp2" (torch's fully_shard instead of DDP) across
real processes on gloo: the options it refuses, parity with plain ds_mirrored under Adam, state bytes per rank,
checkpoints in the plain layout that load on one device, and resumes at world size 1 across engines (against plain
torch on one process)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler

from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from ds_lightning.strategies import MirroredStrategy
from tests.helpers.runner import ds_train
from tests.helpers.sharding_runs import (
    STEPS_PER_EPOCH,
    assert_plain_optimizer_layout,
    epoch_checkpoint,
    fit_args,
    params,
    record,
    resume_on_one_device,
)

FSDP2 = "--trainer.strategy.sharding_engine=fsdp2"


# --- options (no processes) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["fsdp", "FSDP2", None])
def test_sharding_engine_must_be_a_choice(value):
    with pytest.raises(ValueError, match=rf"sharding_engine={value!r} is not a choice.*sharding_engine='fsdp2'"):
        MirroredStrategy(shard_optimizer_state=True, sharding_engine=value)


def test_fsdp2_needs_shard_optimizer_state():
    with pytest.raises(ValueError, match=r"shard_optimizer_state=False shards nothing: set shard_optimizer_state=True"):
        MirroredStrategy(sharding_engine="fsdp2")


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"gradient_compression": "fp16"}, "gradient_compression='fp16'"),
        ({"ddp_comm_hook": default_hooks.allreduce_hook}, "ddp_comm_hook=<function allreduce_hook"),
        ({"hierarchical": True}, "hierarchical=True"),
        ({"model_averaging_period": 4}, "model_averaging_period=4"),
    ],
)
def test_fsdp2_refuses_what_acts_on_ddps_all_reduce(option, named):
    with pytest.raises(ValueError, match=rf"cannot run {named}.*FSDP2 replaces DDP.*sharding_engine='zero'"):
        MirroredStrategy(shard_optimizer_state=True, sharding_engine="fsdp2", **option)


def test_fsdp2_takes_the_defaults_and_refuses_the_load_balancer():
    strategy = MirroredStrategy(shard_optimizer_state=True, sharding_engine="fsdp2")  # hierarchical='auto' is fine
    assert strategy.sharding_engine == "fsdp2"
    with pytest.raises(ValueError, match=r"sharding_engine='fsdp2' replaces DDP; use sharding_engine='zero'"):
        strategy.balance_batches(lambda loader: loader)


# --- through ds-train: parity, bytes, checkpoints ------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(plain_adam_run):
    """Plain ds_mirrored (shared, see conftest) and the fsdp2 engine, 2 ranks, 2 epochs each under Adam."""
    root = plain_adam_run
    ds_train(fit_args(root / "fsdp2", root / "fsdp2" / "params", 2, True, [FSDP2]), timeout=240, ranks=2)
    return root


@pytest.mark.multiprocess
def test_fsdp2_training_matches_plain_ds_mirrored_under_adam(runs):
    plain, sharded = params(runs / "plain" / "params", 0), params(runs / "fsdp2" / "params", 0)
    assert plain["global_step"] == sharded["global_step"] == 2 * STEPS_PER_EPOCH
    pl.seed_everything(0)
    initial = DigitsClassifier(hidden_sizes=(64, 64)).state_dict()
    assert sharded["state_dict"].keys() == plain["state_dict"].keys()
    for name, value in plain["state_dict"].items():
        assert (value - initial[name]).abs().max() > 1e-3  # Adam moved every tensor
        assert_close(sharded["state_dict"][name], value, atol=1e-5, rtol=1e-5)


@pytest.mark.multiprocess
def test_each_rank_holds_about_half_of_the_optimizer_state(runs):
    whole = record(runs / "plain" / "params", 0)["state_bytes"]
    sharded = [record(runs / "fsdp2" / "params", r) for r in range(2)]
    assert {r["optimizer"] for r in sharded} == {"Adam"}  # FSDP2 keeps the user's optimizer, over DTensor shards
    for r in sharded:
        # Every tensor split along dim 0 (64, 64, 10 rows: even), plus Adam's scalar step per parameter on each rank.
        assert 0.45 * whole <= r["state_bytes"] <= 0.55 * whole, (r, whole)
    print(f"optimizer-state bytes per rank: plain {whole}, fsdp2 {[r['state_bytes'] for r in sharded]}")


@pytest.mark.multiprocess
def test_checkpoint_holds_the_plain_layout_and_loads_on_one_device(runs, tmp_path):
    sharded_ckpt, plain_ckpt = epoch_checkpoint(runs / "fsdp2"), epoch_checkpoint(runs / "plain")
    assert_plain_optimizer_layout(sharded_ckpt, plain_ckpt)
    saved = torch.load(sharded_ckpt, weights_only=True)["state_dict"]
    reference = torch.load(plain_ckpt, weights_only=True)["state_dict"]
    assert saved.keys() == reference.keys()
    for name, value in reference.items():
        assert_close(saved[name], value, atol=1e-5, rtol=1e-5)
    # A plain single-device Trainer resumes from it (another world size) and trains on with that state.
    resume_on_one_device(sharded_ckpt, tmp_path)


def torch_second_epoch(checkpoint: Path, adam_state: bool = True) -> dict[str, torch.Tensor]:
    """The runs' second epoch on one process in plain torch, from ``checkpoint`` (written at the end of epoch 0).

    The checkpoint's weights and (unless ``adam_state=False``) Adam's state, then one Adam step per batch of 32 in the
    order Lightning's sampler gives one replica in epoch 1 (``DistributedSampler``, the seed 0 of ``seed_everything``).
    """
    saved = torch.load(checkpoint, weights_only=True)
    model = DigitsClassifier(hidden_sizes=(64, 64), optimizer="adam", lr=0.01)
    model.load_state_dict(saved["state_dict"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if adam_state:
        optimizer.load_state_dict(saved["optimizer_states"][0])
    data = DigitsDataModule(batch_size=32)
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(1)
    for x, y in DataLoader(data.train_set, batch_size=32, sampler=sampler):
        optimizer.zero_grad()
        model.pipeline_loss(model(x), y).backward()
        optimizer.step()
    assert all(float(state["step"]) == STEPS_PER_EPOCH * adam_state + 45 for state in optimizer.state.values())
    return model.state_dict()


@pytest.mark.multiprocess
def test_resumes_at_world_size_1_across_engines(runs, tmp_path):
    """fsdp2 resumes plain ds_mirrored's checkpoint, and the zero engine fsdp2's, on one rank: each ends where the same
    epoch in plain torch on one process ends. The control: that epoch without the checkpoint's Adam state ends far from
    it, so the comparison sees whether the optimizer state came back."""
    plain_checkpoint = epoch_checkpoint(runs / "plain")
    arms = {"fsdp2": (plain_checkpoint, [FSDP2]), "zero": (epoch_checkpoint(runs / "fsdp2"), [])}
    for name, (checkpoint, extra) in arms.items():
        out = tmp_path / name / "params"
        args = [*fit_args(tmp_path / name, out, 2, True, extra), "--trainer.devices=1", f"--ckpt_path={checkpoint}"]
        ds_train(args, timeout=240)
    fsdp2, zero = params(tmp_path / "fsdp2" / "params", 0), params(tmp_path / "zero" / "params", 0)
    assert fsdp2["world_size"] == zero["world_size"] == 1
    assert fsdp2["global_step"] == zero["global_step"] == STEPS_PER_EPOCH + 45  # the second epoch on one rank
    whole = record(runs / "plain" / "params", 0)["state_bytes"]
    assert record(tmp_path / "fsdp2" / "params", 0)["state_bytes"] == whole  # one rank holds all of it
    reference = torch_second_epoch(plain_checkpoint)  # measured: both arms within 2e-7 of it
    for arm in (fsdp2, zero):
        assert arm["state_dict"].keys() == reference.keys()
        for name, value in reference.items():
            assert_close(arm["state_dict"][name], value, atol=1e-5, rtol=1e-5)
    control = torch_second_epoch(plain_checkpoint, adam_state=False)  # measured: up to 0.19 away
    assert max((control[name] - value).abs().max().item() for name, value in reference.items()) > 1e-2


@pytest.mark.multiprocess
def test_accumulation_clipping_and_validation_match_plain(tmp_path):
    """Under accumulation FSDP2 skips the reduce-scatter of every micro-batch but the window's last; clipping takes the
    norm over every rank's shards; validation between steps leaves the parameters gathered, and training goes on."""
    extra = [
        "--trainer.accumulate_grad_batches=2",
        "--trainer.max_steps=6",
        "--trainer.gradient_clip_val=0.05",
        "--trainer.limit_val_batches=2",
        "--trainer.val_check_interval=4",  # batches: after steps 2 and 4
    ]
    syncs = tmp_path / "syncs"
    counted = [FSDP2, "--trainer.callbacks+=tests.helpers.callbacks.RecordGradientSync"]
    counted.append(f"--trainer.callbacks.path={syncs}")
    for name, engine in (("plain", []), ("fsdp2", counted)):
        shard = bool(engine)
        ds_train(fit_args(tmp_path / name, tmp_path / name / "params", 1, shard, [*extra, *engine]), ranks=2)
    plain, sharded = params(tmp_path / "plain" / "params", 0), params(tmp_path / "fsdp2" / "params", 0)
    assert plain["global_step"] == sharded["global_step"] == 6
    assert plain["batches_this_run"] == sharded["batches_this_run"] == 12
    # The first micro-batch of each window ran without gradient synchronisation, on every rank.
    assert [record(syncs, r) for r in range(2)] == [{"off": 6, "on": 6}] * 2
    for name, value in plain["state_dict"].items():
        assert_close(sharded["state_dict"][name], value, atol=1e-5, rtol=1e-5)
