"""The precision benchmark's per-workload defaults and its reading of fabricated GPT results (nothing runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness
from benchmarks.harness.cli import parser, resolve
from benchmarks.harness.writers import write_json
from benchmarks.precision import ops as precision_ops
from benchmarks.precision.driver import AUTO_TARGET, LABELS, Precision, verdict


def _opts(*argv: str) -> argparse.Namespace:
    bench = Precision()
    return resolve(bench, parser(bench).parse_args([*argv, "--accelerator", "cpu", "--out", "unused"]))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ((), (10, 3, 256)),
        (("--quick",), (3, 1, 256)),
        (("--model", "gpt"), (6, 2, 8)),
        (("--model", "gpt", "--quick"), (3, 1, 8)),
        (("--model", "gpt", "--batch-size", "4", "--warmup", "0"), (6, 0, 4)),
    ],
)
def test_per_workload_defaults_fill_only_what_is_unset(argv: tuple[str, ...], expected: tuple[int, ...]):
    opts = _opts(*argv)
    meta = Precision().meta(opts)  # completes the per-workload defaults
    assert (opts.steps, opts.warmup, opts.batch_size) == expected
    assert meta["workload"]["model"] == opts.model and meta["accelerator_used"] == "cpu"
    assert opts.configs == ["fp32", "auto", "bf16"]  # fp16 only on CUDA unless asked for


def _gpt_data() -> dict[str, Any]:
    opts = _opts("--model", "gpt")
    meta = Precision().meta(opts)
    meta["cpu"] = {"machine": "x86_64", "cores": 2, "model": "Test CPU", "flags": ["avx2"]}
    figures = {"fp32": (100.0, 40.0, 8.0, 0.0), "bf16": (200.0, 30.0, 4.0, 1.5)}
    figures.update(fp16=(250.0, 32.0, 4.0, 1.5), auto=(104.0, 40.0, 8.0, 0.0))
    decision = {"chosen": "fp32", "median_ms": {"fp32": 90.0, "bf16": 180.0}, "noise": {}, "margin": {}, "reason": "-"}
    records = [
        {
            "arm": arm,
            "repeat": 0,
            "order": i,
            "seconds": 10.0,
            "rc": 0,
            "chosen": "fp32" if arm == "auto" else arm,
            "step_ms": ms,
            "peak_mb": peak,
            "peak_rss_after_mb": 500.0,
            "activation_mb": act,
            "weight_copy_mb": copies,
            "saved_mb": act + copies,
            "final_loss": 5.0,
            "decision": decision if arm == "auto" else None,
            "probe_s": 1.5 if arm == "auto" else None,
        }
        for i, (arm, (ms, peak, act, copies)) in enumerate(figures.items())
    ]
    settings = {k: v for k, v in vars(opts).items() if k not in ("out", "render")}
    arms = {a: LABELS[a] for a in figures}
    data = {"benchmark": "precision", "settings": settings, **meta, "arms": arms, "baseline": "fp32"}
    return {**data, "records": records}


def test_render_of_a_gpt_result_reports_tokens_per_second_in_gpt_files(tmp_path: Path):
    pytest.importorskip("matplotlib")
    write_json(tmp_path / "precision_gpt.json", _gpt_data())
    harness.main(Precision(), ["--render", str(tmp_path / "precision_gpt.json")])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["precision_gpt.json", "precision_gpt.md", "precision_gpt.png"]
    md = (tmp_path / "precision_gpt.md").read_text()
    assert md.startswith("# fp32 against MixedPrecision on the byte-level GPT (4 layers, d_model 128, 4 heads")
    assert "the demo `GPT` (AdamW" in md and "batch 8 windows of 128 tokens" in md
    assert "| step (ms) | vs fp32 | tokens/s |" in md
    # 8 windows x 128 tokens = 1024 tokens per step: 10240 tokens/s at 100 ms, 5120 at 200 ms
    assert "| fp32 (no callback) | fp32 | 100.0 | - | 10240 | 40.0 |" in md
    assert '| MixedPrecision("bf16") | bf16 | 200.0 | 2.00 | 5120 | 30.0 | 0.75 |' in md
    # auto (104 ms) against fp32 (100 ms): within 1.10; its measuring (1.5 s) is 15 fp32 steps
    assert "auto / fp32 step time (per launch, 1 launches): 1.040; target <= 1.10 in every launch: met" in md
    assert "its measuring took 1.50 s once, 15 fp32 steps" in md
    assert "(auto trained in fp32 1x)" in md
    assert "samples/s" not in md and "DigitsClassifier" not in md


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        ([0.95, 1.0, 1.05], "met"),
        ([1.12, 1.2, 1.3], "missed"),
        ([1.0, 1.08, 1.2], "within noise"),
        (None, "not measured"),
    ],
)
def test_the_verdict_is_met_only_when_every_launch_meets_the_target(runs, expected):
    ratio = harness.spread(runs) if runs else None
    assert verdict(ratio, AUTO_TARGET) == expected


def test_render_of_the_digits_results_says_samples_per_second(tmp_path: Path):
    pytest.importorskip("matplotlib")
    source = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "precision.json"
    if not source.exists():
        pytest.skip("no digits results in this checkout")
    harness.main(Precision(), ["--render", str(source), "--out", str(tmp_path)])
    md = (tmp_path / "precision.md").read_text()
    assert md.startswith("# fp32 against MixedPrecision on the digits MLP 64-1024-1024-10")
    assert "DigitsClassifier 64-1024-1024-10 (SGD lr 0.05 momentum 0.9), batch 256," in md
    assert "| vs fp32 | samples/s |" in md and "tokens" not in md
    assert (tmp_path / "precision.png").exists()


def test_op_profile_writes_both_precisions_per_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """ops.py profiles real steps: a row per top op with fp32, bf16 and their difference, and the total; by default
    into the shared results folder (harness.RESULTS, patched here), not one of its own."""
    assert precision_ops.RESULTS == harness.RESULTS
    monkeypatch.setattr(precision_ops, "RESULTS", tmp_path)
    monkeypatch.setattr("sys.argv", ["ops.py", "--repeats", "1", "--steps", "1", "--top", "3"])
    precision_ops.main()
    lines = (tmp_path / "precision_gpt_ops.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| `")]
    assert len(rows) == 3
    for row in rows:
        fp32, bf16, diff = (float(cell) for cell in row.split("|")[2:5])
        assert fp32 >= 0 and bf16 >= 0
        assert diff == pytest.approx(bf16 - fp32, abs=0.011)
    assert any("aten::mm" in row or "aten::addmm" in row for row in rows)  # the GPT's matmuls are among the top ops
    assert next(line for line in lines if "every op" in line)
