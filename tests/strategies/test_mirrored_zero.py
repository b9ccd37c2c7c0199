"""ds_mirrored with shard_optimizer_state=True (ZeRO stage 1) across real processes on gloo: parity with plain
ds_mirrored under Adam, state bytes per rank, consolidated checkpoints that load on one device and resume, and the
options it refuses."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from torch.testing import assert_close

from ds_lightning.demos import DigitsClassifier
from ds_lightning.sharding import check_shardable
from ds_lightning.strategies import MirroredStrategy
from tests.helpers import zero_workers
from tests.helpers.backup_compose import assert_composed_run_matches_plain_and_resumes
from tests.helpers.controls import assert_far, without_optimizer_state
from tests.helpers.runner import ds_train, free_port, run_module
from tests.helpers.sharding_runs import assert_plain_optimizer_layout, epoch_checkpoint, resume_on_one_device
from tests.helpers.sharding_runs import fit_args as _fit_args
from tests.helpers.sharding_runs import params as _params
from tests.helpers.sharding_runs import record as _record

# --- options (no processes) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_shard_optimizer_state_must_be_a_bool(value):
    with pytest.raises(ValueError, match=rf"shard_optimizer_state={value!r} must be True or False"):
        MirroredStrategy(shard_optimizer_state=value)


def test_sharding_refuses_post_local_sgd_model_averaging():
    with pytest.raises(ValueError, match=r"model_averaging_period=4.*remove model_averaging_period"):
        MirroredStrategy(shard_optimizer_state=True, model_averaging_period=4)


def test_sharding_refuses_an_optimizer_that_loops_over_the_closure():
    with pytest.raises(ValueError, match=r"cannot shard LBFGS.*Adam or SGD"):
        check_shardable(torch.optim.LBFGS(torch.nn.Linear(2, 2).parameters()))


def test_sharding_refuses_parameters_of_several_dtypes():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match=r"torch.float32 on cpu.*torch.float64 on cpu.*model.float\(\)"):
        check_shardable(torch.optim.Adam(model.parameters()))


# --- the sharding module on its own (2 processes, no Lightning) ----------------------------------------------------


@pytest.mark.multiprocess
def test_scheduler_sets_the_lr_the_sharded_step_applies_and_state_round_trips(tmp_path):
    out = tmp_path / "zero"
    mp.spawn(zero_workers.scheduler_drives_the_sharded_step, args=(2, free_port(), str(out)), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(2)]
    for result in ranks:
        # StepLR halves 0.1 each step; a unit gradient moves every parameter (both shards, broadcast) by that lr.
        assert result["moves"] == [[0.1], [0.05], [0.025]], result["moves"]
        assert result["local_lrs"] == [0.1, 0.05, 0.025]  # what the local optimizer applied, synced at its step
        assert not [w for w in result["warnings"] if "lr_scheduler" in w or "optimizer.step" in w], result["warnings"]
        assert result["shard_bytes"] == result["bytes_after_load"]  # loading kept this rank's shard only
        assert result["wrapper_state_after_load"] == 0  # and no second copy of it
        assert result["checkpoint_untouched"]
    whole = ranks[0]["whole"]
    assert ranks[1]["whole"] == {}  # only rank 0 receives the consolidated state
    # The plain optimizer's layout: every parameter's state by index, tensors only.
    model = zero_workers._model()
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        plain.step()
    expected = plain.state_dict()
    assert whole["param_groups"] == expected["param_groups"]
    assert whole["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert_close(whole["state"][index][key], value)
    assert ranks[0]["shard_bytes"] + ranks[1]["shard_bytes"] == sum(
        t.numel() * t.element_size() for s in expected["state"].values() for t in s.values()
    )


# --- through ds-train: parity, bytes, checkpoints ------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(plain_adam_run):
    """Plain (shared, see conftest) and sharded ds_mirrored, 2 epochs each under Adam; a checkpoint per epoch."""
    root = plain_adam_run
    ds_train(_fit_args(root / "sharded", root / "sharded" / "params", 2, True), timeout=240, ranks=2)
    return root


@pytest.mark.multiprocess
def test_sharded_training_matches_plain_ds_mirrored_under_adam(runs):
    plain, sharded = _params(runs / "plain" / "params", 0), _params(runs / "sharded" / "params", 0)
    assert plain["global_step"] == sharded["global_step"] == 46  # 2 epochs of 23 steps
    pl.seed_everything(0)
    initial = DigitsClassifier(hidden_sizes=(64, 64)).state_dict()
    for name, value in plain["state_dict"].items():
        assert not torch.allclose(value, initial[name], atol=1e-3)  # Adam moved every tensor
        assert_close(sharded["state_dict"][name], value, atol=1e-5, rtol=1e-5)
        # The broadcast after each step keeps the replicas identical.
        assert_close(
            _params(runs / "sharded" / "params", 1)["state_dict"][name], sharded["state_dict"][name], atol=0, rtol=0
        )


@pytest.mark.multiprocess
def test_each_rank_holds_about_half_of_the_optimizer_state(runs):
    plain = [_record(runs / "plain" / "params", r) for r in range(2)]
    sharded = [_record(runs / "sharded" / "params", r) for r in range(2)]
    assert plain[0]["state_bytes"] == plain[1]["state_bytes"] > 0
    assert {r["optimizer"] for r in sharded} == {"ZeroRedundancyOptimizer"}
    assert {r["local_optimizer"] for r in sharded} == {"Adam"}
    whole = plain[0]["state_bytes"]
    assert sum(r["state_bytes"] for r in sharded) == whole  # the shards partition the state, nothing doubled
    for record in sharded:
        assert record["state_bytes"] <= 0.55 * whole, (record, whole)
    print(f"optimizer-state bytes per rank: plain {whole}, sharded {[r['state_bytes'] for r in sharded]}")


@pytest.mark.multiprocess
def test_checkpoint_holds_the_plain_layout_and_loads_on_one_device(runs, tmp_path):
    sharded_ckpt = epoch_checkpoint(runs / "sharded")
    state = assert_plain_optimizer_layout(sharded_ckpt, epoch_checkpoint(runs / "plain"))

    # A plain Adam in one process takes the state as it is.
    model = DigitsClassifier(hidden_sizes=(64, 64), optimizer="adam", lr=0.01)
    adam = model.configure_optimizers()
    adam.load_state_dict(state)
    assert len(adam.state) == 6 and all(float(s["step"]) == 23 for s in adam.state.values())

    # And a plain single-device Trainer resumes from it (another world size) and trains on with that state.
    resume_on_one_device(sharded_ckpt, tmp_path)


@pytest.mark.multiprocess
def test_resume_on_two_sharded_ranks_equals_the_uninterrupted_run(runs, tmp_path):
    (checkpoint,) = (runs / "sharded" / "ckpt").glob("epoch=0-*.ckpt")
    out = tmp_path / "params"
    ds_train([*_fit_args(tmp_path, out, 2, True), f"--ckpt_path={checkpoint}"], timeout=240, ranks=2)
    straight, resumed = _params(runs / "sharded" / "params", 0), _params(out, 0)
    assert resumed["global_step"] == straight["global_step"] == 46
    assert resumed["batches_this_run"] == 23  # the second epoch only
    for name, value in straight["state_dict"].items():
        assert_close(resumed["state_dict"][name], value, atol=1e-5, rtol=1e-5)
    shards = [_record(out, r)["state_bytes"] for r in range(2)]
    assert shards == [_record(runs / "sharded" / "params", r)["state_bytes"] for r in range(2)]  # sharded again

    # The control: the same file without Adam's moments resumes at the same step and ends far from the straight run,
    # so the comparison above sees whether the shards got their state back.
    dropped = without_optimizer_state(checkpoint, tmp_path / "dropped.ckpt")
    control_out = tmp_path / "control" / "params"
    ds_train([*_fit_args(tmp_path / "control", control_out, 2, True), f"--ckpt_path={dropped}"], timeout=240, ranks=2)
    control = _params(control_out, 0)
    assert control["global_step"] == 46 and control["batches_this_run"] == 23  # it resumed the file
    assert_far(straight["state_dict"], control["state_dict"], 1e-3, "the resume without Adam's state")


# --- composed: PowerSGD, accumulation, LR scaling, a step scheduler and BackupAndRestore ------------------------------


@pytest.mark.multiprocess
def test_composes_with_powersgd_accumulation_lr_scaling_and_resumes_from_a_backup(tmp_path):
    """Adam with a StepLR per step; global batch 32 = 2 ranks x 8 x 2 accumulated; 12 steps over 4 epochs."""
    compression = {"gradient_compression": "powersgd", "powersgd_rank": 1, "powersgd_start_iter": 2}
    assert_composed_run_matches_plain_and_resumes(tmp_path, {**compression, "shard_optimizer_state": True}, compression)


@pytest.mark.multiprocess
def test_manual_optimization_with_two_optimizers_matches_plain(tmp_path):
    """Each optimizer is sharded on its own; stepping one of them every other batch (on every rank) stays in parity."""
    results = []
    for shard in (0, 1):
        out = tmp_path / f"manual{shard}.pt"
        run = run_module("tests.helpers.zero_manual", [str(out), str(shard)], timeout=240)
        assert run.returncode == 0, run.output[-4000:]
        results.append(torch.load(out, weights_only=True))
    plain, sharded = results
    assert plain["optimizers"] == ["Adam", "SGD"]
    assert sharded["optimizers"] == ["ZeroRedundancyOptimizer", "ZeroRedundancyOptimizer"]
    for name, value in plain["state_dict"].items():
        assert_close(sharded["state_dict"][name], value, atol=1e-6, rtol=1e-6)
