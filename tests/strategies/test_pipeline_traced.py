"""ds_pipeline on models that are not an nn.Sequential: traced splits of TiedGPT and transformers' GPT-2.

Each multi-process launch runs several arms; every rank's exit code is checked. Parity is against the same model
trained by a plain single-process Trainer, within 1e-5; the tied-weight tests have a control (the same model with
the head untied, which is what stages would train without summing the tied weight's gradient).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_lightning import PipelineStrategy
from ds_lightning.pipeline.graph_split import TracingRefused, check_split_points, trace_split
from tests.helpers.controls import assert_far, distance, without_optimizer_state
from tests.helpers.runner import REPO, run_ranks, worker_env
from tests.helpers.traced_runs import do_run

TOL = 1e-5
CUTS4 = ["blocks.1", "blocks.2", "blocks.3"]
BF16 = {
    "bf16_mixed": {"model": "tied", "trainer": {"max_steps": 3, "precision": "bf16-mixed"}},
    "bf16_true": {"model": "hf", "trainer": {"max_steps": 3, "precision": "bf16-true"}},
}


def launch(root: Path, name: str, ranks: int, runs: list[dict[str, Any]]) -> None:
    spec = root / f"{name}.json"
    spec.write_text(json.dumps({"runs": runs}))
    run = run_ranks("tests.helpers.traced_runs", [str(spec)], ranks, timeout=240)
    assert run.returncodes == [0] * ranks, run.output[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("traced")
    names = (
        *("tied2", "hf2", "ckpt2", "sharded2", "bf16_mixed", "bf16_true", "interleaved"),
        *("tied4", "hf4", "resume4", "resume4_sharded", "dp2"),
    )
    out = {name: str(root / f"{name}.pt") for name in names}
    ckpt = str(root / "two_stages.ckpt")
    sharded = str(root / "two_stages_sharded.ckpt")  # a folder: each stage writes its own part
    launch(
        root,
        "two",
        2,
        [
            {"model": "tied", "strategy": "ds_pipeline", "devices": 2, "out": out["tied2"]},
            {
                "model": "hf",
                "strategy": "ds_pipeline",
                "devices": 2,
                "options": {"split_points": ["transformer.h.2"], "schedule": "GPipe"},
                "out": out["hf2"],
            },
            {
                "model": "tied",
                "strategy": "ds_pipeline",
                "devices": 2,
                "trainer": {"max_steps": 2},
                "save": ckpt,
                "out": out["ckpt2"],
            },
            {
                "model": "tied",
                "strategy": "ds_pipeline",
                "devices": 2,
                "options": {"state_dict_type": "sharded"},
                "trainer": {"max_steps": 2},
                "save": sharded,
                "out": out["sharded2"],
            },
            *[
                {**BF16[name], "strategy": "ds_pipeline", "devices": 2, "out": out[name]}
                for name in ("bf16_mixed", "bf16_true")
            ],
            # Two stages per process: 4 stages over 2 ranks, the tied head on the other rank's second stage.
            {
                "model": "tied",
                "strategy": "ds_pipeline",
                "devices": 2,
                "options": {"schedule": "Interleaved1F1B"},
                "out": out["interleaved"],
            },
        ],
    )
    four = {"strategy": "ds_pipeline", "devices": 4}
    launch(
        root,
        "four",
        4,
        [
            {
                **four,
                "model": "tied",
                "options": {"split_points": ["blocks.1", "blocks.2", "blocks.3"]},
                "out": out["tied4"],
            },
            {**four, "model": "hf", "out": out["hf4"]},
            {**four, "model": "tied", "ckpt_path": ckpt, "out": out["resume4"]},
            {**four, "model": "tied", "ckpt_path": sharded, "out": out["resume4_sharded"]},
            # 2 stages x 2 replicas: the tied sum over each pipeline, then the average over the replicas.
            {**four, "model": "tied", "options": {"data_parallel_size": 2}, "out": out["dp2"]},
        ],
    )
    results: dict[str, Any] = {name: torch.load(path, weights_only=False) for name, path in out.items()}
    results["ckpt"], results["sharded"] = ckpt, sharded
    results["root"] = root
    for kind in ("tied", "hf"):
        results[f"{kind}_ref"] = do_run({"model": kind, "out": str(root / f"{kind}_ref.pt")})
    for name, run in BF16.items():
        results[f"{name}_ref"] = do_run({**run, "out": str(root / f"{name}_ref.pt")})
    results["untied_ref"] = do_run({"model": "tied", "untie": True, "out": str(root / "untied_ref.pt")})
    return results


@pytest.mark.parametrize("arm", ["tied2", "tied4", "hf2", "hf4", "interleaved", "dp2"])
def test_traced_pipeline_matches_one_process(runs: dict[str, Any], arm: str) -> None:
    ref = runs[f"{'hf' if arm.startswith('hf') else 'tied'}_ref"]
    got = runs[arm]
    torch.testing.assert_close(got["losses"], ref["losses"], atol=TOL, rtol=TOL)
    assert got["final"].keys() == ref["final"].keys()  # keyed as the unsplit model, tied head included
    for name, tensor in ref["final"].items():
        torch.testing.assert_close(got["final"][name], tensor, atol=TOL, rtol=TOL, msg=name)
    assert ref["final"] != {} and distance(ref["final"], got["final"]) <= TOL


def test_tied_weight_stays_one_weight(runs: dict[str, Any]) -> None:
    for arm in ("tied2", "tied4", "interleaved", "dp2"):
        final = runs[arm]["final"]
        torch.testing.assert_close(final["net.head.weight"], final["net.token.weight"], atol=0, rtol=0)
    # Control: stages that did not sum the tied gradient would train two weights, as the untied model does; that
    # ends far from the result, so the parity above would catch it.
    assert_far(runs["tied_ref"]["final"], runs["untied_ref"]["final"], 100 * TOL, "the untied model")
    untied = runs["untied_ref"]["final"]
    assert (untied["net.head.weight"] - untied["net.token.weight"]).abs().max() > 100 * TOL


def test_auto_split_cuts_the_largest_module_list_evenly(runs: dict[str, Any]) -> None:
    assert runs["tied2"]["balance_used"] == [2, 2]
    assert runs["hf4"]["balance_used"] == [1, 1, 1, 1]


def test_checkpoint_from_two_stages_resumes_on_one_process_and_on_four(runs: dict[str, Any], tmp_path: Path) -> None:
    ref = runs["tied_ref"]["final"]
    four = runs["resume4"]
    assert four["global_step"] == 3
    one = do_run({"model": "tied", "ckpt_path": runs["ckpt"], "out": str(tmp_path / "one.pt")})
    for name, tensor in ref.items():
        torch.testing.assert_close(four["final"][name], tensor, atol=TOL, rtol=TOL, msg=name)
        torch.testing.assert_close(one["final"][name], tensor, atol=TOL, rtol=TOL, msg=name)
    # Control: the same checkpoint without its optimizer state (Adam's moments) resumes elsewhere.
    dropped = without_optimizer_state(Path(runs["ckpt"]), tmp_path / "dropped.ckpt")
    control = do_run({"model": "tied", "ckpt_path": str(dropped), "out": str(tmp_path / "control.pt")})
    assert_far(ref, control["final"], 100 * TOL, "a resume without optimizer state")


@pytest.mark.parametrize("arm", ["bf16_mixed", "bf16_true"])
def test_bf16_pipelines_compute_as_one_bf16_process(runs: dict[str, Any], arm: str) -> None:
    got, ref, fp32 = runs[arm], runs[f"{arm}_ref"], runs[f"{BF16[arm]['model']}_ref"]
    # The first step's loss comes from the same weights and the same bf16 arithmetic per micro-batch.
    assert abs(got["losses"][0] - ref["losses"][0]) <= 1e-6
    # Control: in fp32 that loss is measurably different, so the pipeline did run in bf16.
    assert abs(got["losses"][0] - fp32["losses"][0]) > 2e-5
    torch.testing.assert_close(got["losses"], ref["losses"], atol=1e-3, rtol=0)
    dtypes = {t.dtype for t in got["final"].values()}
    assert dtypes == ({torch.bfloat16} if arm == "bf16_true" else {torch.float32})
    # Weights after 3 AdamW steps: bf16 rounding of the summed micro-batch gradients moves them by about one lr.
    torch.testing.assert_close(got["final"], ref["final"], atol=5e-3, rtol=0)


def test_a_v_schedule_is_refused_at_setup_on_every_rank(tmp_path: Path) -> None:
    spec = tmp_path / "v.json"
    run = {"model": "tied", "strategy": "ds_pipeline", "devices": 2, "out": str(tmp_path / "v.pt")}
    spec.write_text(json.dumps({"runs": [{**run, "options": {"schedule": "ZBVZeroBubble"}}]}))
    result = run_ranks("tests.helpers.traced_runs", [str(spec)], 2, timeout=120)
    assert all(code != 0 for code in result.returncodes), result.output[-3000:]
    assert result.output.count("places two stages of a V on each process") >= 2  # every rank, before any step
    assert not (tmp_path / "v.pt").exists()


def test_a_sharded_checkpoint_from_two_stages_resumes_on_four_and_on_one_process(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    folder = Path(runs["sharded"])
    # Each stage wrote its own part; rank 0 gathered nothing (one DCP file per rank, plus Lightning's meta.pt).
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (folder / "meta.pt").is_file() and all(p.stat().st_size > 10_000 for p in folder.glob("*.distcp"))
    ref = runs["tied_ref"]["final"]
    for name, tensor in ref.items():
        torch.testing.assert_close(runs["resume4_sharded"]["final"][name], tensor, atol=TOL, rtol=TOL, msg=name)
    # Lightning's own tool turns the folder into one file that a plain one-process Trainer resumes.
    output = tmp_path / "consolidated.ckpt"
    command = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(folder)]
    subprocess.run([*command, "--output_file", str(output)], cwd=REPO, env=worker_env(), check=True, timeout=120)
    one = do_run({"model": "tied", "ckpt_path": str(output), "out": str(tmp_path / "one.pt")})
    for name, tensor in ref.items():
        torch.testing.assert_close(one["final"][name], tensor, atol=TOL, rtol=TOL, msg=name)
    # Control: the consolidated file without its optimizer state resumes elsewhere.
    dropped = without_optimizer_state(output, tmp_path / "dropped.ckpt")
    control = do_run({"model": "tied", "ckpt_path": str(dropped), "out": str(tmp_path / "control.pt")})
    assert_far(ref, control["final"], 100 * TOL, "a resume without optimizer state")


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor's value: torch.export cannot trace it
            return x
        return -x


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.gate = _Gate()
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.gate(self.first(x)))


def test_an_untraceable_model_is_refused_naming_the_submodule_and_the_fix() -> None:
    model = _Gated()
    with pytest.raises(TracingRefused, match=r"submodule 'gate'.*control flow on tensor values") as err:
        trace_split(model, (torch.randn(2, 4),), {}, ["second"], [0, 1])
    assert "torch.where" in str(err.value)
    # The model is left as it was: tracing it again after a fix works (torch's split markers are removed).
    model.gate = nn.Identity()
    split = trace_split(model, (torch.randn(2, 4),), {}, ["second"], [0, 1])
    assert split.n_stages == 2 and set(split.local_parameters) == {
        "first.weight",
        "first.bias",
        "second.weight",
        "second.bias",
    }


def test_a_split_point_that_is_not_a_submodule_is_refused() -> None:
    with pytest.raises(TracingRefused, match=r"'blocks\.9', which is not a submodule"):
        trace_split(_Gated(), (torch.randn(2, 4),), {}, ["blocks.9"], [0])


@pytest.mark.parametrize(
    ("value", "match"),
    [(["a", "a"], "twice"), ([], "non-empty list"), ("every", "must be 'auto'"), (["a b"], "must be 'auto'")],
)
def test_split_points_are_validated_at_construction(value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_split_points(value)
    with pytest.raises(ValueError, match=match):
        PipelineStrategy(split_points=value)  # type: ignore[arg-type]


def test_split_points_and_balance_together_are_refused() -> None:
    with pytest.raises(ValueError, match="both say where to cut"):
        PipelineStrategy(split_points=["blocks.2"], balance=[2, 2])
    assert PipelineStrategy(split_points="auto", balance=[1, 3]).balance == [1, 3]
