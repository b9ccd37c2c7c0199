"""ds_pipeline: parity with single-process training, checkpoints across layouts, balance and early errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import ds_lightning
from ds_lightning.pipeline import PipelineLayout
from ds_lightning.pipeline.schedules import SCHEDULES
from tests.helpers.controls import assert_far, without_optimizer_state
from tests.helpers.pipeline_runs import PipeMLP, SequentialData, make_data
from tests.helpers.runner import REPO, ds_train, example_config, quiet_trainer_args, worker_env

STEPS = 3
EPOCH = 4  # 128 rows in batches of 32; checkpoints are taken at epoch ends so a resume starts a fresh epoch
LR, MOMENTUM = 0.1, 0.9


# --- reference ------------------------------------------------------------------------------------------------------


def reference_training(
    initial: dict[str, torch.Tensor],
    steps: int,
    batch_size: int = 32,
    clip: float | None = None,
    accumulate: int = 1,
    depth: int = 8,
) -> tuple[nn.Sequential, list[float], torch.optim.Optimizer]:
    """Plain single-process torch: the same model, batches and SGD as the runs."""
    model = PipeMLP(depth=depth)
    model.load_state_dict(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = make_data()
    batches = list(DataLoader(data, batch_size=batch_size, shuffle=False))
    losses, cursor = [], 0
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            x, y = batches[cursor % len(batches)]
            cursor += 1
            loss = nn.functional.cross_entropy(model.net(x), y)
            (loss / accumulate).backward()
            loss = loss.detach()
            losses.append(float(loss))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        scheduler.step()
    return model.net, losses, opt


def launch(tmp_path: Path, name: str, devices: int, runs: list[dict[str, Any]], timeout: float = 420) -> None:
    for run in runs:
        run.setdefault("devices", devices)
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"runs": runs}))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.pipeline_runs", str(spec)],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout[-8000:]}"


def load(path: Path) -> dict[str, Any]:
    assert path.exists(), f"{path} was not written"
    return torch.load(path, weights_only=False)


def assert_matches_reference(
    result: dict[str, Any], steps: int, moved_by: float = 1e-4, **reference_kwargs: Any
) -> None:
    ref_net, ref_losses, _ = reference_training(result["initial"], steps, **reference_kwargs)
    assert result["net_type"] == "Sequential", "after fit the module must hold the whole nn.Sequential again"
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    # What training_step logged reached rank 0's callback metrics (the progress bar and loggers read them).
    assert result["metrics"]["train_loss"] == pytest.approx(result["losses"][-1], abs=1e-6)
    final = {k.removeprefix("net."): v for k, v in result["final"].items()}
    for name, ref in ref_net.state_dict().items():
        torch.testing.assert_close(final[name], ref, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # Control: every stage trained, each layer's parameters beyond ``moved_by``, 10x the 1e-5 above (a stage whose
    # gradients never arrived, or a run that never stepped, would leave its layers where they started). Measured: in
    # 3 steps the first layer of the deep tanh stack moves least, about 3e-4.
    moved = {k.split(".")[1] for k, v in result["final"].items() if (v - result["initial"][k]).abs().max() > moved_by}
    layers_with_params = {k.split(".")[1] for k in result["initial"]}
    assert moved == layers_with_params, f"layers whose parameters barely moved: {layers_with_params - moved}"


def _fit(out: Path, options: dict[str, Any], steps: int = STEPS, **extra: Any) -> dict[str, Any]:
    trainer = {"max_steps": steps, "limit_val_batches": 0, **extra.pop("trainer", {})}
    return {"strategy": "ds_pipeline", "options": options, "trainer": trainer, "out": str(out), **extra}


# --- the two launches (module-scoped: each starts its processes once) -----------------------------------------------


@pytest.fixture(scope="module")
def two_stage_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pp2")
    runs = [_fit(root / f"{name}.pt", {"schedule": name, "n_microbatches": 4}) for name in SCHEDULES]
    runs += [
        _fit(root / "clip.pt", {"schedule": "1F1B", "n_microbatches": 4}, trainer={"gradient_clip_val": 0.05}),
        _fit(
            root / "accumulate.pt", {"schedule": "GPipe", "n_microbatches": 2}, trainer={"accumulate_grad_batches": 2}
        ),
        _fit(root / "checkpointing.pt", {"schedule": "1F1B", "activation_checkpointing": True}),
        _fit(
            root / "summary.pt",
            {"schedule": "GPipe", "n_microbatches": 4},
            model={"example": True},
            trainer={"enable_model_summary": True},
        ),
        _fit(
            root / "validation.pt",
            {"schedule": "1F1B", "n_microbatches": 4},
            steps=4,
            trainer={"limit_val_batches": 2, "val_check_interval": 2, "num_sanity_val_steps": 0},
        ),
        _fit(
            root / "ckpt2.pt",
            {"schedule": "1F1B", "n_microbatches": 4},
            steps=EPOCH,
            save=str(root / "two_stages.ckpt"),
        ),
        {
            "strategy": "ds_mirrored",
            "batch_size": 16,
            "trainer": {"max_steps": EPOCH, "limit_val_batches": 0},
            "out": str(root / "mirrored.pt"),
            "save": str(root / "mirrored.ckpt"),
        },
        _fit(
            root / "auto.pt",
            {"schedule": "Interleaved1F1B", "n_microbatches": 2, "balance": "auto"},
            steps=1,
            model={"depth": 5, "heavy": 3},
        ),
    ]
    runs += [
        {
            "strategy": "ds_pipeline",
            "options": {"schedule": schedule, "n_microbatches": 8},
            "action": "predict",
            "batch_size": 20,
            "out": str(root / f"predict_{schedule}.pt"),
        }
        for schedule in ("GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
    ]
    launch(root, "pp2", 2, runs)
    return root


@pytest.fixture(scope="module")
def four_stage_runs(two_stage_runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pp4")
    single_device_run(2 * EPOCH, ckpt_in=two_stages(two_stage_runs), ckpt_out=root / "single.ckpt")
    runs = [_fit(root / f"{name}.pt", {"schedule": name, "n_microbatches": 8}) for name in SCHEDULES]
    runs += [
        _fit(root / "dp.pt", {"schedule": "GPipe", "n_microbatches": 4, "data_parallel_size": 2}, batch_size=16),
        _fit(root / "from2.pt", {"n_microbatches": 4}, steps=EPOCH + 2, ckpt_path=str(two_stages(two_stage_runs))),
        _fit(root / "from_single.pt", {"n_microbatches": 4}, steps=2 * EPOCH + 2, ckpt_path=str(root / "single.ckpt")),
        _fit(
            root / "from_mirrored.pt",
            {"n_microbatches": 4},
            steps=EPOCH + 2,
            ckpt_path=str(two_stage_runs / "mirrored.ckpt"),
        ),
    ]
    launch(root, "pp4", 4, runs)
    return root


def two_stages(root: Path) -> Path:
    return root / "two_stages.ckpt"


def single_device_run(
    steps: int, ckpt_in: Path | None = None, ckpt_out: Path | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """A plain single-device Trainer on the same model and batches: the reference for resumed runs."""
    pl.seed_everything(0, verbose=False)
    model = PipeMLP()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, SequentialData(32), ckpt_path=str(ckpt_in) if ckpt_in else None)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    return model.state_dict(), model.losses


def resumed_without_momentum(checkpoint: Path, steps: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The control for a resume: the single-device run from ``checkpoint`` with the SGD momentum dropped.

    Measured: it ends 4e-3 to 1.2e-2 from the resumed runs, which match their references to 1e-5.
    """
    state, _ = single_device_run(steps, ckpt_in=without_optimizer_state(checkpoint, tmp_path / "no_momentum.ckpt"))
    return state


# --- parity ---------------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_processes_match_single_process_training(two_stage_runs, schedule):
    assert_matches_reference(load(two_stage_runs / f"{schedule}.pt"), STEPS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_four_processes_match_single_process_training(four_stage_runs, schedule):
    assert_matches_reference(load(four_stage_runs / f"{schedule}.pt"), STEPS)


@pytest.mark.multiprocess
def test_two_stages_by_two_replicas_match_single_process(four_stage_runs):
    # Each replica takes 16 of the reference's 32 rows per step; averaging their gradients gives the 32-row mean.
    result = load(four_stage_runs / "dp.pt")
    ref_net, _, _ = reference_training(result["initial"], STEPS)
    final = {k.removeprefix("net."): v for k, v in result["final"].items()}
    for name, ref in ref_net.state_dict().items():
        torch.testing.assert_close(final[name], ref, atol=1e-5, rtol=1e-5)
    assert len(result["losses"]) == STEPS


@pytest.mark.multiprocess
def test_gradient_clipping_uses_the_global_norm_over_all_stages(two_stage_runs):
    result = load(two_stage_runs / "clip.pt")
    # Clipped to a norm of 0.05, the first layer moves only 4e-5 in 3 steps (measured): 3x the tolerance.
    assert_matches_reference(result, STEPS, moved_by=3e-5, clip=0.05)
    # The clip must have been active, or this test would not distinguish global from per-stage norms.
    unclipped, _, _ = reference_training(result["initial"], STEPS)
    final = {k.removeprefix("net."): v for k, v in result["final"].items()}
    assert not torch.allclose(final["0.0.weight"], unclipped.state_dict()["0.0.weight"], atol=1e-4)


@pytest.mark.multiprocess
def test_model_summary_with_an_example_input_runs_a_forward_pipeline(two_stage_runs):
    # ModelSummary calls the model on example_input_array on every rank; that is a collective forward pipeline.
    assert_matches_reference(load(two_stage_runs / "summary.pt"), STEPS)


@pytest.mark.multiprocess
def test_accumulate_grad_batches_is_honoured(two_stage_runs):
    result = load(two_stage_runs / "accumulate.pt")
    assert_matches_reference(result, STEPS, accumulate=2)
    # Control: without accumulation (a step per batch) the same 3 steps end far from the run (measured: 1.5e-2).
    unaccumulated, _, _ = reference_training(result["initial"], STEPS)
    final = {k.removeprefix("net."): v for k, v in result["final"].items()}
    assert_far(final, unaccumulated.state_dict(), 1e-3, "training without accumulation")


@pytest.mark.multiprocess
def test_activation_checkpointing_keeps_the_numbers(two_stage_runs):
    assert_matches_reference(load(two_stage_runs / "checkpointing.pt"), STEPS)


@pytest.mark.multiprocess
def test_validation_runs_forward_only_with_the_trained_weights(two_stage_runs):
    result = load(two_stage_runs / "validation.pt")
    x_val, y_val = make_data()[:32]
    expected = []
    for steps in (2, 4):
        net, _, _ = reference_training(result["initial"], steps)
        with torch.no_grad():
            expected += [float(nn.functional.cross_entropy(net(x_val), y_val))]
            x2, y2 = make_data()[32:64]
            expected += [float(nn.functional.cross_entropy(net(x2), y2))]
    torch.testing.assert_close(torch.tensor(result["val_losses"]), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert "val_loss" in result["metrics"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_predict_pads_partial_batches_and_returns_exact_outputs(two_stage_runs, schedule):
    # ZBVZeroBubble and DualPipeV fail in torch's own eval(); ours runs their forward actions only.
    result = load(two_stage_runs / f"predict_{schedule}.pt")
    model = PipeMLP()
    model.load_state_dict(result["initial"])
    with torch.no_grad():
        expected = model.net(make_data().tensors[0])
    # 128 rows in batches of 20 with 8 micro-batches: batches of 20 and 8 rows, the 20s padded to 24.
    torch.testing.assert_close(result["predictions"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.multiprocess
def test_auto_balance_puts_the_heavy_layer_alone_on_its_stage(two_stage_runs):
    result = load(two_stage_runs / "auto.pt")
    # Six layers, layer 3 heavy, four stages (two per process): the slowest stage is fastest with layer 3 alone.
    balance = result["balance_used"]
    assert balance is not None and len(balance) == 4 and sum(balance) == 6
    starts = [sum(balance[:i]) for i in range(4)]
    assert 3 in starts and balance[starts.index(3)] == 1, balance


# --- checkpoints ----------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_checkpoint_is_consolidated_and_loads_in_a_plain_model(two_stage_runs):
    checkpoint = torch.load(two_stages(two_stage_runs), weights_only=False)
    result = load(two_stage_runs / "ckpt2.pt")
    model = PipeMLP()
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, result["final"][name])
    _, _, ref_opt = reference_training(result["initial"], EPOCH)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    opt.load_state_dict(checkpoint["optimizer_states"][0])
    states = [state for _, state in sorted(opt.state_dict()["state"].items())]
    ref_states = list(ref_opt.state_dict()["state"].values())
    assert len(states) == len(ref_states) == len(list(model.parameters()))
    for state, ref_state in zip(states, ref_states, strict=True):
        torch.testing.assert_close(state["momentum_buffer"], ref_state["momentum_buffer"], atol=1e-5, rtol=1e-5)


@pytest.mark.multiprocess
def test_single_device_trainer_resumes_a_pipeline_checkpoint_like_its_own(two_stage_runs, tmp_path):
    # Lightning decides which batches a resumed run sees; a pipeline checkpoint must resume exactly like one made
    # by a single-device Trainer at the same step.
    own = tmp_path / "own.ckpt"
    single_device_run(EPOCH, ckpt_out=own)
    expected, expected_losses = single_device_run(EPOCH + 3, ckpt_in=own)
    got, losses = single_device_run(EPOCH + 3, ckpt_in=two_stages(two_stage_runs))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), atol=1e-5, rtol=1e-5)
    assert_far(got, resumed_without_momentum(two_stages(two_stage_runs), EPOCH + 3, tmp_path), 1e-3, "no momentum")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("run", "source", "steps"),
    [
        ("from2", "two_stages", EPOCH + 2),
        ("from_single", "single", 2 * EPOCH + 2),
        ("from_mirrored", "mirrored", EPOCH + 2),
    ],
)
def test_four_stages_resume_checkpoints_of_other_layouts(two_stage_runs, four_stage_runs, tmp_path, run, source, steps):
    checkpoint = {
        "two_stages": two_stages(two_stage_runs),
        "single": four_stage_runs / "single.ckpt",
        "mirrored": two_stage_runs / "mirrored.ckpt",
    }[source]
    result = load(four_stage_runs / f"{run}.pt")
    expected, expected_losses = single_device_run(steps, ckpt_in=checkpoint)
    for name, value in expected.items():
        torch.testing.assert_close(
            result["final"][name], value, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert result["global_step"] == steps
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected_losses), atol=1e-5, rtol=1e-5)
    assert_far(result["final"], resumed_without_momentum(checkpoint, steps, tmp_path), 1e-3, "no momentum")


@pytest.mark.multiprocess
def test_mirrored_checkpoint_matches_single_device_training(two_stage_runs):
    checkpoint = torch.load(two_stage_runs / "mirrored.ckpt", weights_only=False)
    initial = load(two_stage_runs / "ckpt2.pt")["initial"]
    ref_net, _, _ = reference_training(initial, EPOCH)
    for name, ref in ref_net.state_dict().items():
        torch.testing.assert_close(checkpoint["state_dict"][f"net.{name}"], ref, atol=1e-5, rtol=1e-5)


# --- early errors ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "Zigzag"}, "not a torch pipeline schedule"),
        ({"n_microbatches": 0}, "n_microbatches=0"),
        ({"balance": [2, 0]}, "balance entries=0"),
        ({"balance": "fast"}, "balance='fast'"),
        ({"schedule": "GPipe", "stages_per_rank": 2}, "runs one stage per process"),
        ({"schedule": "ZBVZeroBubble", "stages_per_rank": 3}, "exactly 2 stages per process"),
        ({"pipe_module": "not a name"}, "pipe_module="),
        ({"data_parallel_size": 0}, "data_parallel_size=0"),
        ({"timeout": 0}, "timeout=0"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ds_lightning.PipelineStrategy(**kwargs)


@pytest.mark.parametrize(
    ("devices", "kwargs", "message"),
    [
        (3, {"data_parallel_size": 2}, "world size 3 is not stages x data_parallel_size"),
        (4, {"schedule": "1F1B", "n_microbatches": 2}, r"n_microbatches=2 < 4 stages"),
        (2, {"balance": [1, 1, 1]}, "needs 3 processes, but the world size is 2"),
    ],
)
def test_layout_errors_come_before_any_process_starts(devices, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pl.Trainer(accelerator="cpu", devices=devices, strategy=ds_lightning.PipelineStrategy(**kwargs))


def test_a_process_without_trainable_layers_is_refused_for_every_rank():
    from ds_lightning.pipeline.split import check_every_rank_trains

    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    layout = PipelineLayout(world_size=4)
    with pytest.raises(ValueError, match=r"process 1 would hold only layers \[1\] \(ReLU\)"):
        check_every_rank_trains(seq, [range(0, 1), range(1, 2), range(2, 4), range(4, 5)], layout, "loop")
    check_every_rank_trains(seq, [range(0, 2), range(2, 5)], PipelineLayout(2), "loop")
    # Two stages per process: a parameter-free stage is fine when the process's other stage trains.
    check_every_rank_trains(seq, [range(0, 1), range(1, 2), range(2, 4), range(4, 5)], PipelineLayout(2, 1, 2), "loop")


def test_layout_arithmetic():
    layout = PipelineLayout(world_size=8, data_parallel_size=2)
    assert (layout.pipeline_size, layout.stages) == (4, 4)
    assert [layout.coordinates(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert PipelineLayout(4, -1, 1, stages=2).data_parallel_size == 2
    assert PipelineLayout(2, 1, 2).stage_indices(0, "v") == [0, 3]
    assert PipelineLayout(2, 1, 2).stage_indices(1, "loop") == [1, 3]


class _NoLoss(PipeMLP):
    pipeline_loss = None  # type: ignore[assignment]


class _NotSequential(PipeMLP):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.ModuleList(list(self.net))  # type: ignore[assignment]


class _ExtraParams(PipeMLP):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class _TupleOutput(PipeMLP):
    def __init__(self) -> None:
        super().__init__()
        self.net.append(_Pair())

    def pipeline_loss(self, output, target):
        return nn.functional.cross_entropy(output[0], target)


def _one_process_fit(model: pl.LightningModule, strategy: ds_lightning.PipelineStrategy, batch_size: int = 32) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(make_data(), batch_size=batch_size))


@pytest.mark.parametrize(
    ("model", "kwargs", "batch_size", "error", "message"),
    [
        (PipeMLP, {"balance": [4]}, 32, ValueError, r"balance=\[4\] sums to 4 but .* has 9 layers"),
        (PipeMLP, {"schedule": "Interleaved1F1B", "balance": [5, 5]}, 32, ValueError, "sums to 10"),
        (
            lambda: PipeMLP(depth=0),
            {"schedule": "Interleaved1F1B"},
            32,
            ValueError,
            "2 pipeline stages but .* 1 layers",
        ),
        (PipeMLP, {"n_microbatches": 4}, 30, ValueError, "batch size 30 is not a multiple of n_microbatches=4"),
        (_NoLoss, {}, 32, TypeError, "pipeline_loss"),
        (_NotSequential, {}, 32, TypeError, "found a ModuleList"),
        (_ExtraParams, {}, 32, ValueError, r"\['head.weight', 'head.bias'\] are outside it"),
        (_TupleOutput, {}, 32, TypeError, "the last stage returned tuple"),
    ],
)
def test_contract_errors_name_the_problem(model, kwargs, batch_size, error, message):
    with pytest.raises(error, match=message):
        _one_process_fit(model(), ds_lightning.PipelineStrategy(**kwargs), batch_size)


def test_a_single_process_pipeline_trains_and_drops_a_partial_last_batch():
    model = PipeMLP()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ds_lightning.PipelineStrategy(n_microbatches=8),
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.warns(UserWarning, match="last training batch of each epoch has 4 samples"):
        # 100 rows in batches of 24: four full batches, and 4 rows that 8 micro-batches cannot split.
        trainer.fit(model, DataLoader(make_data(100), batch_size=24))
    assert trainer.global_step == 4
    assert not torch.equal(model.state_dict()["net.0.0.weight"], initial["net.0.0.weight"])


# --- ds-train -------------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_example_pipeline_config_trains_the_digits_with_ds_train(tmp_path):
    report, trace = tmp_path / "report.json", tmp_path / "trace.json"
    run = ds_train(
        [
            "fit",
            *example_config("pipeline.yaml"),
            *quiet_trainer_args(tmp_path),
            f"--trainer.strategy.init_args.trace_path={trace}",
            f"--trainer.callbacks.output_json={report}",
        ],
        timeout=240,
    )
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in run.output
    summary = json.loads(report.read_text())
    assert summary["val_acc"] > 0.9, summary
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    # 3 traced steps x 4 micro-batches x (forward + backward) on each of the 2 ranks.
    assert len(spans) == 3 * 4 * 2 * 2
    assert trace.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
def test_accumulation_and_lr_scaling_callbacks_drive_the_pipeline(tmp_path):
    out = tmp_path / "steps"
    ds_train(
        [
            "fit",
            *example_config("pipeline.yaml"),
            *quiet_trainer_args(tmp_path),
            "--trainer.max_steps=4",
            "--trainer.limit_val_batches=0",
            "--trainer.strategy.init_args.trace_path=null",
            "--trainer.callbacks+=ds_lightning.callbacks.GradientAccumulation",
            "--trainer.callbacks.steps=2",
            "--trainer.callbacks+=ds_lightning.callbacks.LRScaling",
            "--trainer.callbacks.base_batch_size=16",
            "--trainer.callbacks.warmup_steps=2",
            "--trainer.callbacks+=tests.helpers.callbacks.RecordSteps",
            f"--trainer.callbacks.path={out}",
        ],
        timeout=240,
    )
    for rank in (0, 1):  # both stages read the same batches: the effective batch is 32 x 1 replica x 2 = 64
        record = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert record["global_step"] == 4 and record["micro_batches"] == 8
        # 0.05 x 64 / 16, warmed up over 2 steps from 0.1 of it.
        assert [round(lr, 9) for _, lr in record["lrs"]] == [0.02, 0.11, 0.2, 0.2]
