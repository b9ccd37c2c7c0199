"""ds_mirrored with gradient_compression="auto" through ds-train on real gloo processes: YAML, loopback parity with
"none", decisions on every rank, and the auto state in the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

from ds_lightning.comm.compression import GradientCompressor
from ds_lightning.strategies import MirroredStrategy, mirrored
from tests.helpers.runner import ds_train, example_config, quiet_trainer_args

MIRRORED = example_config("mirrored.yaml")
STEPS, INTERVAL, START = 12, 4, 10
BATCH = 120  # with the 1,438 training digits on 2 ranks: 6 steps an epoch


@pytest.mark.parametrize("value", [0, -1, 1.5, "often", None])
def test_bad_auto_interval_fails_at_construction_naming_the_value_and_the_fix(value):
    with pytest.raises(ValueError, match=rf"auto_interval={value!r} must be an int >= 1.*auto_interval=500"):
        MirroredStrategy(gradient_compression="auto", auto_interval=value)


def test_auto_refuses_the_two_level_all_reduce_at_construction():
    with pytest.raises(ValueError, match=r"gradient_compression='auto'.*hierarchical=False"):
        MirroredStrategy(gradient_compression="auto", hierarchical=True)
    assert MirroredStrategy(gradient_compression="auto", hierarchical=False).auto_interval == 500


@pytest.mark.parametrize(
    ("compression", "hierarchical", "expected"), [("auto", "auto", False), ("fp16", "auto", "auto")]
)
def test_auto_compression_asks_for_the_flat_all_reduce_under_the_default_hierarchical(
    monkeypatch, one_rank_group, compression, hierarchical, expected
):
    """Checks the arguments only: the two-level path itself is tested on real processes elsewhere."""
    asked = []
    monkeypatch.setattr(mirrored, "host_groups", lambda setting, *args: asked.append(setting))
    monkeypatch.setattr(GradientCompressor, "register", lambda *args, **kwargs: None)
    strategy = MirroredStrategy(gradient_compression=compression, hierarchical=hierarchical)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.model = DistributedDataParallel(torch.nn.Linear(2, 2))
    strategy._register_ddp_hooks()
    assert asked == [expected]


def _fit(root: Path, out: Path, extra: list[str], max_steps: int = STEPS) -> None:
    ds_train(
        [
            "fit",
            *MIRRORED,
            *extra,
            *quiet_trainer_args(root),
            f"--trainer.max_steps={max_steps}",
            "--trainer.limit_val_batches=0",
            "--trainer.callbacks+=tests.helpers.callbacks.SaveParams",
            f"--trainer.callbacks.path={out}",
            "--model.hidden_sizes=[32]",
        ],
        ranks=2,  # both ranks at once, forked warm: the subject is the training, not Lightning's launcher
    )


@pytest.mark.multiprocess
def test_auto_from_yaml_picks_none_on_loopback_and_matches_none(tmp_path):
    config = tmp_path / "auto.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: ds_lightning.strategies.MirroredStrategy\n    init_args:\n"
        f"      gradient_compression: auto\n      auto_interval: {INTERVAL}\n      powersgd_start_iter: {START}\n"
    )
    auto_out, none_out, record, decisions = tmp_path / "auto", tmp_path / "none", tmp_path / "r.json", tmp_path / "d"
    _fit(
        tmp_path / "a",
        auto_out,
        [
            f"--config={config}",
            "--trainer.callbacks+=tests.helpers.callbacks.RecordStrategy",
            f"--trainer.callbacks.path={record}",
            "--trainer.callbacks+=tests.helpers.callbacks.RecordAuto",
            f"--trainer.callbacks.path={decisions}",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
        ],
    )
    _fit(tmp_path / "n", none_out, [])

    info = json.loads(record.read_text())
    assert info["gradient_compression"] == "auto" and info["auto_interval"] == INTERVAL, info
    assert info["ddp_comm_hook"] == "auto_hook", info  # the one dispatching hook, registered once

    ranks = [json.loads(Path(f"{decisions}.rank{r}.json").read_text()) for r in (0, 1)]
    made, made1 = ([(d["step"], d["choice"], d["probed"]) for d in r["decisions"]] for r in ranks)
    assert made == made1  # predictions differ (each rank times its own steps); rank 0's choice is everyone's
    # Set-up and every INTERVAL steps a probe; at START (PowerSGD's warm-up over) a decision on the last figures.
    assert made == [(0, "none", True), (4, "none", True), (8, "none", True), (10, "none", False)], ranks[0]
    assert "powersgd" not in ranks[0]["decisions"][0]["predicted_s"]  # not a candidate before START
    assert set(ranks[0]["decisions"][-1]["predicted_s"]) == {"none", "fp16", "powersgd"}
    figures = ranks[0]["figures"]
    assert figures["float32"]["latency_s"] > 0 and figures["float32"]["bandwidth"] > 0, figures

    for rank in (0, 1):
        auto = torch.load(f"{auto_out}.rank{rank}.pt", weights_only=True)
        plain = torch.load(f"{none_out}.rank{rank}.pt", weights_only=True)
        assert auto["global_step"] == plain["global_step"] == STEPS
        for name, value in plain["state_dict"].items():
            assert_close(auto["state_dict"][name], value, atol=1e-6, rtol=1e-6)

    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    saved = torch.load(checkpoint, weights_only=True)["ds_mirrored"]
    assert saved["gradient_compression"] == "auto" and saved["world_size"] == 2
    for state in saved["compression_states"]:
        assert state["name"] == "auto" and state["choice"] == "none" and state["step"] == STEPS
        assert state["figures"]["world_size"] == 2


@pytest.mark.multiprocess
def test_resume_restores_the_choice_and_the_probe_schedule(tmp_path):
    """A run resumed from its epoch-0 checkpoint runs the saved choice, probes at the same steps and ends with the
    same params; the control resumes from the same checkpoint without the auto state and ends elsewhere.

    A test-side seam (``tests.helpers.callbacks.SlowLink``) makes every decision from the start of training see a
    100 kB/s link, so auto leaves the default: fp16 at the probe of step 4 (PowerSGD's warm-up is not over), PowerSGD
    once the warm-up ends at step ``START``. Only ``max_epochs`` bounds the runs: Lightning 2.6.6 stops a resume from
    an end-of-epoch checkpoint early when ``max_steps`` and ``limit_train_batches`` are both set
    (docs/fault-tolerance.md, limits). The 1,438 training digits split over 2 ranks are 719 per rank: batches of 120
    make an epoch 6 steps, so 2 epochs are ``STEPS``.
    """

    def run(name: str, *extra: str) -> tuple[dict, dict, dict]:
        out, decisions, start = (tmp_path / name / part for part in ("params", "auto", "start"))
        _fit(
            tmp_path / name,
            out,
            [
                "--trainer.max_epochs=2",
                f"--data.batch_size={BATCH}",
                "--trainer.strategy=ds_lightning.strategies.MirroredStrategy",
                "--trainer.strategy.gradient_compression=auto",
                f"--trainer.strategy.auto_interval={INTERVAL}",
                f"--trainer.strategy.powersgd_start_iter={START}",
                "--trainer.callbacks+=tests.helpers.callbacks.SlowLink",
                f"--trainer.callbacks.path={start}",
                "--trainer.callbacks+=tests.helpers.callbacks.RecordAuto",
                f"--trainer.callbacks.path={decisions}",
                "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                f"--trainer.callbacks.dirpath={tmp_path / name / 'ckpt'}",
                "--trainer.callbacks.save_top_k=-1",
                *extra,
            ],
            max_steps=-1,
        )
        record = json.loads(Path(f"{decisions}.rank0.json").read_text())
        started = json.loads(Path(f"{start}.rank0.json").read_text())
        return torch.load(f"{out}.rank0.pt", weights_only=True), record, started

    straight, straight_record, _ = run("straight")
    checkpoint = tmp_path / "straight" / "ckpt" / f"epoch=0-step={STEPS // 2}.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in checkpoint.parent.iterdir())
    saved = torch.load(checkpoint, weights_only=True)
    assert [s["choice"] for s in saved["ds_mirrored"]["compression_states"]] == ["fp16", "fp16"]
    resumed, resumed_record, resumed_start = run("resumed", f"--ckpt_path={checkpoint}")

    assert straight["global_step"] == resumed["global_step"] == STEPS
    assert resumed["batches_this_run"] == STEPS // 2  # only the second epoch ran again
    made = [(d["step"], d["choice"], d["probed"]) for d in straight_record["decisions"]]
    # Set-up (before the seam) on the loopback probe; then the slow link; at START PowerSGD's warm-up is over.
    assert made == [(0, "none", True), (4, "fp16", True), (8, "fp16", True), (10, "powersgd", False)]
    # The resumed run starts its second epoch on the saved choice and step count, then the saved run's schedule. A
    # step count that restarted at 0 would probe at its step 4 instead and never reach START.
    assert resumed_start == {"choice": "fp16", "step": STEPS // 2}
    assert [(d["step"], d["choice"], d["probed"]) for d in resumed_record["decisions"]] == [
        (0, "none", True),
        *made[2:],
    ]
    assert straight_record["step"] == resumed_record["step"] == STEPS
    assert straight_record["choice"] == resumed_record["choice"] == "powersgd"
    for name, value in straight["state_dict"].items():
        assert_close(resumed["state_dict"][name], value, atol=1e-6, rtol=1e-6)

    # Control: the same checkpoint without the auto state resumes on the set-up choice with a fresh step count.
    del saved["ds_mirrored"]
    dropped = tmp_path / "dropped.ckpt"
    torch.save(saved, dropped)
    control, control_record, control_start = run("control", f"--ckpt_path={dropped}")
    assert control_start == {"choice": "none", "step": 0}
    assert [(d["step"], d["choice"]) for d in control_record["decisions"]] == [(0, "none"), (4, "fp16")]
    assert control_record["choice"] == "fp16"  # PowerSGD never ran: its warm-up restarted with the step count
    differences = [(control["state_dict"][n] - v).abs().max().item() for n, v in straight["state_dict"].items()]
    assert max(differences) > 1e-4, differences  # far beyond the resume's 1e-6
