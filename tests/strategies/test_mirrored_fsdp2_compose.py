"""ds_mirrored's fsdp2 engine with what a LightningModule may add: mixed precision (Lightning's bf16-mixed and our
MixedPrecision callback's fp16 with loss scaling), manual optimization, and two optimizers over disjoint layers with
checkpoints that resume. Each suite is one launch of 2 gloo ranks (``tests.helpers.fsdp2_compose``) that fits plain
ds_mirrored and the fsdp2 engine on the same batches, for parity."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.testing import assert_close

from ds_lightning.strategies import MirroredStrategy
from tests.helpers.backup_compose import assert_composed_run_matches_plain_and_resumes
from tests.helpers.fsdp2_compose import ENGINES, FP16_INIT_SCALE, classifier, data, two_optimizers
from tests.helpers.runner import run_ranks
from tests.helpers.sharding_runs import assert_plain_optimizer_layouts, params, record

STEPS = 16  # per epoch: 256 samples, batches of 8, 2 ranks


def launch(out: Path, suite: str) -> Path:
    run = run_ranks("tests.helpers.fsdp2_compose", [str(out), suite], 2, timeout=280)  # under pytest's 300 s
    assert run.returncode == 0, run.output[-6000:]
    return out


def assert_parity(out: Path, arm: str, tolerance: float) -> None:
    """The fsdp2 arm's final parameters are plain's (on rank 0; each rank gathered the same whole tensors), and
    training moved them by far more than ``tolerance``."""
    plain, sharded = params(out / f"{arm}-plain", 0), params(out / f"{arm}-fsdp2", 0)
    assert plain["global_step"] == sharded["global_step"] > 0
    assert sharded["state_dict"].keys() == plain["state_dict"].keys()
    initial = classifier().state_dict()  # seeded in __init__
    for name, value in plain["state_dict"].items():
        assert (value.float() - initial[name]).abs().max() > 10 * tolerance
        assert_close(sharded["state_dict"][name], value, atol=tolerance, rtol=tolerance)


def assert_half_the_state_per_rank(out: Path, arm: str) -> None:
    """Each rank of the fsdp2 arm holds about half of each optimizer's state (every tensor has an even number of rows;
    Adam's scalar ``step`` stays whole)."""
    whole = record(out / f"{arm}-plain", 0)["state_bytes"]
    for rank in range(2):
        sharded = record(out / f"{arm}-fsdp2", rank)["state_bytes"]
        assert len(sharded) == len(whole)
        assert all(0.45 * w <= s <= 0.55 * w for s, w in zip(sharded, whole, strict=True)), (sharded, whole)


# --- mixed precision -----------------------------------------------------------------------------------------------


def test_16_mixed_on_cpu_becomes_bf16_mixed_under_fsdp2():
    """Lightning itself swaps fp16 AMP for bf16 on CPU (with a warning), before any strategy runs: ours changes nothing.
    fp16 on CPU comes from our MixedPrecision('fp16') callback instead (tested below)."""
    strategy = MirroredStrategy(shard_optimizer_state=True, sharding_engine="fsdp2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="16-mixed", logger=False)
    assert trainer.precision == "bf16-mixed"
    assert any("Using `precision='bf16-mixed'` instead" in str(w.message) for w in caught)


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("fsdp2_precision"), "precision")


@pytest.mark.multiprocess
@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", "torch.bfloat16"), ("bf16-true", "torch.bfloat16")])
def test_bf16_matches_plain(precision_runs, precision, dtype):
    out = precision_runs
    for engine in ENGINES:
        for rank in range(2):
            seen = record(out / f"{precision}-{engine}", rank)
            assert seen["precision"] == precision and seen["logits_dtype"] == dtype, seen
            assert seen["fully_sharded"] == (engine == "fsdp2")
    assert_half_the_state_per_rank(out, precision)
    # Both engines compute the same forward from the same parameters; they differ only in how two ranks' gradients are
    # summed (DDP's all-reduce, FSDP2's reduce-scatter): identical or one fp32 rounding apart (measured: identical).
    # One rounding apart can flip a bf16 cast by 2**-8 relative and Adam carries it on, so the bound is looser than
    # fp32's 1e-5: 1e-3 under autocast (fp32 parameters), 4e-3 with bf16 parameters (about one bf16 ulp, 2**-8, of a
    # weight below 1). Training moves the weights by more than 10x either bound (checked), and a skipped gradient
    # synchronisation moves them apart by up to lr = 1e-2 per step.
    assert_parity(out, precision, 1e-3 if precision == "bf16-mixed" else 4e-3)


@pytest.mark.multiprocess
def test_fp16_loss_scaling_matches_plain_and_skips_the_same_steps(precision_runs):
    """The callback's GradScaler sees DTensor gradient shards under fsdp2; torch all-reduces found-inf over the mesh,
    so every rank skips the overflowing steps together, as plain ds_mirrored does."""
    out = precision_runs
    plain = record(out / "fp16-plain", 0)
    assert plain["precision"] == "16-mixed" and plain["logits_dtype"] == "torch.float16", plain
    assert 0 < plain["skipped_steps"] < 2 * STEPS
    assert plain["loss_scale"] == FP16_INIT_SCALE / 2 ** plain["skipped_steps"]  # halved at each overflow
    for rank in range(2):
        sharded = record(out / "fp16-fsdp2", rank)
        assert sharded["fully_sharded"]
        assert (sharded["skipped_steps"], sharded["loss_scale"]) == (plain["skipped_steps"], plain["loss_scale"])
    # fp16 keeps 11 bits (2**-11 relative), finer than bf16; the same argument as for bf16-mixed, over 2 epochs with
    # clipping by norm, whose norm fsdp2 sums shard by shard over the ranks: a rounding apart (measured: 1.5e-5).
    assert_parity(out, "fp16", 1e-3)


# --- manual optimization with two optimizers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def manual_runs(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("fsdp2_manual"), "manual")


@pytest.mark.multiprocess
def test_manual_optimization_with_two_optimizers_matches_plain(manual_runs):
    for engine in ENGINES:
        seen = record(manual_runs / f"manual-{engine}", 0)
        assert seen["optimizers"] == ["Adam", "SGD"]  # the user's own, over DTensor shards under fsdp2
        assert seen["fully_sharded"] == (engine == "fsdp2")
    assert_half_the_state_per_rank(manual_runs, "manual")  # each optimizer sharded on its own
    # 32-bit: the engines differ only in how two ranks' gradients are summed; 1e-5 as for the one-optimizer runs.
    assert_parity(manual_runs, "manual", 1e-5)


@pytest.mark.multiprocess
def test_resuming_from_the_epoch_checkpoint_continues_the_run(manual_runs):
    """A second fsdp2 fit resumed from its own epoch-0 checkpoint (both optimizers' state scattered back into shards)
    ends where the straight run did."""
    for engine in ENGINES:
        straight = params(manual_runs / f"manual-{engine}", 0)
        resumed = params(manual_runs / f"manual-{engine}-resumed", 0)
        assert resumed["global_step"] == straight["global_step"]
        assert resumed["batches_this_run"] == STEPS  # the second epoch only
        for name, value in straight["state_dict"].items():
            assert_close(resumed["state_dict"][name], value, atol=1e-6, rtol=1e-6)


def fit_on_one_device(checkpoint: Path, root: Path) -> tuple[pl.Trainer, dict[str, torch.Tensor]]:
    """A plain single-device Trainer resumes the 2-epoch manual run from ``checkpoint`` (its epoch 0)."""
    pl.seed_everything(0, verbose=False)
    model = two_optimizers()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, data(), ckpt_path=checkpoint)
    return trainer, model.state_dict()


@pytest.mark.multiprocess
def test_checkpoint_holds_each_optimizers_plain_state_and_loads_on_one_device(manual_runs, tmp_path):
    (sharded_ckpt,) = (manual_runs / "manual-fsdp2").glob("epoch=0-*.ckpt")
    (plain_ckpt,) = (manual_runs / "manual-plain").glob("epoch=0-*.ckpt")
    adam, sgd = assert_plain_optimizer_layouts(sharded_ckpt, plain_ckpt)
    assert set(adam["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and set(sgd["state"][0]) == {"momentum_buffer"}
    assert adam["state"][0]["exp_avg"].shape == (32, 16)  # whole, not a shard
    # A plain one-device Trainer resumes from it with both optimizers' state, as from plain ds_mirrored's checkpoint.
    trainer, from_sharded = fit_on_one_device(sharded_ckpt, tmp_path / "sharded")
    adam_steps = {float(s["step"]) for s in trainer.optimizers[0].state.values()}
    assert adam_steps == {STEPS + 2 * STEPS}  # epoch 0 at 2 ranks, then 32 batches on one device: not restarted
    _, from_plain = fit_on_one_device(plain_ckpt, tmp_path / "plain")
    for name, value in from_plain.items():
        assert_close(from_sharded[name], value, atol=1e-5, rtol=1e-5)


# --- accumulation, LR scaling, a step scheduler and BackupAndRestore ----------------------------------------------


@pytest.mark.multiprocess
def test_accumulation_lr_scaling_and_a_backup_resume_match_plain(tmp_path):
    """Adam with a StepLR per step; global batch 32 = 2 ranks x 8 x 2 accumulated; 12 steps over 4 epochs. The
    backups are gathered from the shards on every rank at the same step, and a run killed at step 5 resumes from one
    to the uninterrupted run's parameters, with every sample once per epoch."""
    fsdp2 = {"shard_optimizer_state": True, "sharding_engine": "fsdp2"}
    state = assert_composed_run_matches_plain_and_resumes(tmp_path, fsdp2, {})
    plain_latest = sorted((tmp_path / "plain_backups").glob("backup-step*.ckpt"))[-1]
    plain_state = torch.load(plain_latest, weights_only=True)["optimizer_states"][0]["state"]
    assert {k: v["exp_avg"].shape for k, v in state.items()} == {k: v["exp_avg"].shape for k, v in plain_state.items()}
