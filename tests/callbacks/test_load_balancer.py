"""DynamicLoadBalancer: share arithmetic, the sampler, parity with one process, shifting to the fast rank, refusals."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ds_lightning.callbacks import DynamicLoadBalancer
from ds_lightning.data.share_plan import SharePlan, split_sizes
from ds_lightning.data.share_sampler import ShareBatchSampler
from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from tests.helpers.controls import assert_far
from tests.helpers.models import TinyData, TinyModule
from tests.helpers.runner import ds_train, example_config, quiet_trainer_args
from tests.helpers.trainers import quiet_trainer

MIRRORED = example_config("mirrored.yaml")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch_size": 1}, "global_batch_size=1"),
        ({"global_batch_size": 64, "interval": -1}, "interval=-1"),
        ({"global_batch_size": 64, "ema": 0.0}, "ema=0.0"),
        ({"global_batch_size": 64, "hysteresis": 2.0}, "hysteresis=2.0"),
        ({"global_batch_size": 64, "min_share": 0.0}, "min_share=0.0"),
        ({"global_batch_size": 64, "initial_shares": [1.0, -1.0]}, r"initial_shares=\[1.0, -1.0\]"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLoadBalancer(**kwargs)


def test_split_sizes_is_proportional_sums_exactly_and_respects_the_minimum():
    assert split_sizes(64, [3.0, 1.0], 1) == [48, 16]
    assert split_sizes(10, [1.0, 1.0, 1.0], 1) == [4, 3, 3]
    assert split_sizes(64, [1000.0, 1.0], 8) == [56, 8]
    with pytest.raises(ValueError, match="cannot give 3 ranks at least 4"):
        split_sizes(10, [1.0, 1.0, 1.0], 4)


def test_plan_follows_throughput_with_smoothing_hysteresis_lag_and_window_alignment():
    plan = SharePlan(global_batch_size=60, world_size=2, min_share=0.1, ema=0.5, hysteresis=0.1)
    assert plan.sizes_at(0) == [30, 30]
    assert plan.observe([100.0, 100.0], now=5, lag=2) is False  # equal speeds: nothing to change
    assert plan.observe([300.0, 100.0], now=10, lag=2, window=4, origin=1) is True
    # Estimate (200, 100) -> 40/20, starting on the first window boundary (from batch 1, every 4) at or after 12.
    assert plan.sizes_at(12) == [30, 30] and plan.sizes_at(13) == [40, 20]
    assert plan.observe([205.0, 100.0], now=20, lag=2) is False  # within 10%: hysteresis keeps the sizes
    restored = SharePlan(global_batch_size=60, world_size=2, min_share=0.1, ema=0.5, hysteresis=0.1)
    restored.load_state_dict(plan.state_dict())
    assert restored.changes == plan.changes and restored.estimate == plan.estimate


def test_sampler_gives_every_sample_once_per_epoch_with_equal_steps_under_changing_sizes():
    plan = SharePlan(global_batch_size=10, world_size=3, min_share=0.1, ema=1.0, hysteresis=0.0)
    plan.observe([1.0, 2.0, 7.0], now=0, lag=2)
    samplers = [ShareBatchSampler(47, plan, rank, True, 0, lambda: 0) for rank in range(3)]
    for sampler in samplers:
        sampler.set_epoch(3)
    batches = [list(sampler) for sampler in samplers]
    assert [len(b) for b in batches] == [len(s) for s in samplers] == [5, 5, 5]
    seen = [i for rank in batches for batch in rank for i in batch]
    assert sorted(seen) == list(range(47))  # 4 full batches and the last 7 samples, nothing twice
    assert [len(b) for b in batches[2]][:3] == [3, 3, 7]  # even (4, 3, 3) until batch 2, then 1:2:7
    order = torch.randperm(47, generator=torch.Generator().manual_seed(3)).tolist()
    assert [i for step in zip(*batches, strict=True) for part in step for i in part] == order


# --- processes ------------------------------------------------------------------------------------------------


def _reference_params(
    global_batch: int, steps: int, lr: float, unweighted: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """One process on the global batches, in the permutation every rank's sampler walks.

    ``unweighted``: the control, each rank's share of the batch (in rank order) averaged as plain DDP would, the mean
    of the ranks' mean losses instead of the mean over every sample.
    """
    pl.seed_everything(0)
    model = DigitsClassifier(hidden_sizes=(32,), lr=lr, momentum=0.0)
    data = DigitsDataModule(batch_size=global_batch)
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    order = list(sampler)
    optimizer = model.configure_optimizers()
    for step in range(steps):
        subset = Subset(data.train_set, order[step * global_batch : (step + 1) * global_batch])
        x, y = next(iter(DataLoader(subset, batch_size=global_batch)))
        optimizer.zero_grad()
        if unweighted is None:
            model.pipeline_loss(model(x), y).backward()
        else:
            shares = zip(x.split(unweighted), y.split(unweighted), strict=True)
            (sum(model.pipeline_loss(model(xs), ys) for xs, ys in shares) / len(unweighted)).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _args(tmp_path: Path, out: Path, balancer: list[str], model: list[str], steps: int) -> list[str]:
    return [
        "fit",
        *MIRRORED,
        *quiet_trainer_args(tmp_path),
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks+=ds_lightning.callbacks.DynamicLoadBalancer",
        *balancer,
        "--trainer.callbacks+=tests.helpers.callbacks.SaveParams",
        f"--trainer.callbacks.path={out}",
        "--trainer.callbacks+=tests.helpers.callbacks.RecordSteps",
        f"--trainer.callbacks.path={out}",
        "--model=tests.helpers.models.SlowRankDigits",
        "--model.hidden_sizes=[32]",
        *model,
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("balancer_batch", "loader_batch"),
    [
        (["--trainer.callbacks.global_batch_size=48"], []),
        ([], ["--data.batch_size=24"]),  # DynamicLoadBalancer() takes 24 per rank x 2 ranks
    ],
    ids=["explicit", "default-from-loader"],
)
def test_forced_uneven_shares_match_one_process_on_the_global_batch(tmp_path, balancer_batch, loader_batch):
    steps, lr = 8, 0.2
    out = tmp_path / "run"
    ds_train(
        _args(
            tmp_path,
            out,
            ["--trainer.callbacks.interval=0", "--trainer.callbacks.initial_shares=[3, 1]", *balancer_batch],
            [f"--model.lr={lr}", *loader_batch],
            steps,
        ),
        ranks=2,  # both ranks at once, forked warm: the subject is the training, not Lightning's launcher
    )
    reference = _reference_params(48, steps, lr)
    for rank, size in ((0, 36), (1, 12)):
        saved = torch.load(f"{out}.rank{rank}.pt", weights_only=True)
        record = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert record["batch_sizes"] == [size] * steps
        for name, value in reference.items():
            assert_close(saved["state_dict"][name], value, atol=1e-5, rtol=1e-5)
    # Control: without the weighting (each rank's 36- and 12-sample mean averaged equally) the run ends elsewhere
    # (measured: 1.3e-2 away; the run is within 1.5e-8 of the reference).
    unweighted = _reference_params(48, steps, lr, unweighted=[36, 12])
    assert_far(saved["state_dict"], unweighted, 1e-3, "plain DDP averaging")


@pytest.mark.multiprocess
def test_shares_move_to_the_fast_rank_and_step_counts_stay_equal(tmp_path):
    steps = 40
    out = tmp_path / "run"
    ds_train(
        [
            *_args(
                tmp_path,
                out,
                ["--trainer.callbacks.global_batch_size=64", "--trainer.callbacks.interval=5"],
                ["--model.slow_rank=1", "--model.delay_ms=0.5"],  # about 16 ms more per even step on rank 1
                steps,
            ),
            # The weighting composes with compression (both live in the one comm hook).
            "--trainer.strategy=ds_lightning.strategies.MirroredStrategy",
            "--trainer.strategy.gradient_compression=fp16",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path / 'logs'}",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_checkpointing=true",
        ],
        ranks=2,
    )
    records = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert records[0]["global_step"] == records[1]["global_step"] == steps
    assert len(records[0]["batch_sizes"]) == len(records[1]["batch_sizes"]) == steps
    data = DigitsDataModule()
    data.setup("fit")
    per_epoch, rest = divmod(len(data.train_set), 64)
    totals = [r0 + r1 for r0, r1 in zip(records[0]["batch_sizes"], records[1]["batch_sizes"], strict=True)]
    assert totals == ([64] * per_epoch + [rest]) * (steps // (per_epoch + 1)) + [64] * (steps % (per_epoch + 1))
    assert records[0]["batch_sizes"][0] == 32  # even at the start
    assert records[0]["batch_sizes"][-1] > 32, records[0]["batch_sizes"]  # the fast rank took the larger share
    assert records[0]["sync_rounds"] == steps  # fp16's hook ran every step

    # Logged every interval, the same on every rank: the shares the plan chose and each rank's throughput.
    rows = [
        r for r in csv.DictReader(next((tmp_path / "logs").rglob("metrics.csv")).open()) if r.get("balance/share_rank0")
    ]
    assert rows and int(rows[0]["step"]) >= 4  # nothing before the first re-division, after batch 5
    last = rows[-1]
    assert float(last["balance/share_rank0"]) + float(last["balance/share_rank1"]) == pytest.approx(1.0)
    assert float(last["balance/throughput_rank0"]) > float(last["balance/throughput_rank1"]) > 0

    # The checkpoint carries the plan, so a resumed run starts from the shares it had reached.
    checkpoint = torch.load(next((tmp_path / "logs").rglob("*.ckpt")), weights_only=False)
    state = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("DynamicLoadBalancer"))
    assert state["batches"] == steps
    in_force = [sizes for start, sizes in state["plan"]["changes"] if start <= steps - 1][-1]
    assert in_force == [records[0]["batch_sizes"][-1], records[1]["batch_sizes"][-1]]
    # The sizes in force are the split of the latest throughput estimate (no bound on how fast this machine is).
    estimate = state["plan"]["estimate"]
    assert len(estimate) == 2 and estimate[0] > estimate[1]
    latest, proposal = state["plan"]["changes"][-1][1], split_sizes(64, estimate, 4)  # min_share 0.05 of 64
    assert latest == proposal or all(abs(p - c) <= 0.05 * c for p, c in zip(proposal, latest, strict=True))


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ("ds_parameter_server", "cannot run under ds_parameter_server: asynchronous workers already run at their own"),
        ("ds_pipeline", "cannot run under ds_pipeline: the stages of a pipeline must all see the same batch"),
        ("ddp", "cannot run under DDPStrategy: .* Use strategy='ds_mirrored'"),
    ],
)
def test_other_strategies_refuse_the_balancer_with_the_reason(strategy, message):
    # A real Trainer for two processes: building it starts none; the refusal comes from the callback's setup.
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    with pytest.raises(MisconfigurationException, match=message):
        DynamicLoadBalancer(global_batch_size=64).setup(trainer, TinyModule(), "fit")


def test_one_process_leaves_the_balancer_idle(tmp_path):
    balancer = DynamicLoadBalancer(global_batch_size=16)
    trainer = quiet_trainer(tmp_path, [balancer], max_steps=2)
    with pytest.warns(UserWarning, match="one data-parallel process to balance"):
        trainer.fit(TinyModule(), TinyData())
    assert balancer.plan is None and trainer.global_step == 2
