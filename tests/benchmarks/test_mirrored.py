"""The mirrored benchmark's per-workload defaults and its reading of fabricated GPT and digits results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness
from benchmarks.harness.cli import parser, resolve
from benchmarks.harness.writers import write_json
from benchmarks.mirrored.auto import AUTO
from benchmarks.mirrored.driver import COMPRESSIONS, STRATEGIES, Mirrored

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _opts(*argv: str) -> argparse.Namespace:
    bench = Mirrored()
    opts = resolve(bench, parser(bench).parse_args([*argv, "--out", "unused"]))
    bench.meta(opts)  # completes the per-workload defaults
    return opts


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ((), (80, 10, 32, 3)),
        (("--quick",), (10, 2, 32, 1)),
        (("--model", "gpt"), (10, 3, 8, 3)),
        (("--model", "gpt", "--quick"), (4, 2, 8, 1)),
        (("--model", "gpt", "--steps", "7", "--batch-size", "3"), (7, 3, 3, 3)),
    ],
)
def test_per_workload_defaults_fill_only_what_is_unset(argv: tuple[str, ...], expected: tuple[int, ...]):
    opts = _opts(*argv)
    assert (opts.steps, opts.warmup, opts.batch_size, opts.repeats) == expected


def test_meta_names_the_gpt_workload_and_its_shape():
    meta = Mirrored().meta(_opts("--model", "gpt", "--gpt-layers", "2", "--gpt-block", "64"))
    assert meta["workload"] == {"model": "gpt", "n_layer": 2, "n_head": 4, "d_model": 128, "block_size": 64}
    assert "byte-level GPT (2 layers" in meta["workload_label"] and "context 64" in meta["workload_label"]


def test_the_auto_arm_runs_interleaved_with_the_others_at_the_given_interval():
    experiment = Mirrored().experiment(_opts("--auto-interval", "50"))
    auto = experiment.arm(AUTO)
    assert auto.params == {"mode": "lightning", "strategy": "ds_mirrored", "compression": "auto"}
    names = [a.name for a in experiment.arms]
    assert names == ["ds_mirrored", "lightning_ddp", "plain_ddp", "fp16", "powersgd", AUTO]
    assert experiment.baseline == "ds_mirrored"
    assert {n for _, a in experiment.order() for n in [a.name]} >= {AUTO, "ds_mirrored"}
    assert _opts("--auto-interval", "50").auto_interval == 50 and _opts().auto_interval is None  # None: the default


def _auto_reading(choice: str = "none") -> dict[str, Any]:
    figures = {
        "world_size": 2,
        "float32": {"latency_s": 40e-6, "bandwidth": 2.0e9},
        "float16": {"latency_s": 40e-6, "bandwidth": 0.5e9},
        "compress_s": {"fp16": 1e-3, "powersgd": 3e-3},
    }
    decisions = [{"step": 0, "choice": "none", "probed": True}, {"step": 10, "choice": choice, "probed": False}]
    return {"choice": choice, "decisions": decisions, "figures": figures}


def _gpt_data(auto_ms: tuple[float, ...] = (104.0,), none_ms: tuple[float, ...] = (100.0,)) -> dict[str, Any]:
    opts = _opts("--model", "gpt")
    step_ms = {"ds_mirrored": none_ms[0], "lightning_ddp": 125.0, "plain_ddp": 80.0, "fp16": 90.0, "powersgd": 110.0}
    full = 3.5e6
    sent = {"ds_mirrored": full, "lightning_ddp": full, "fp16": full / 2, "powersgd": full / 4}
    records = [
        {
            "arm": arm,
            "repeat": 0,
            "order": i,
            "seconds": 30.0,
            "rc": 0,
            "step_ms": ms,
            **({"comm_bytes_per_step": sent[arm], "uncompressed_bytes_per_step": full} if arm in sent else {}),
        }
        for i, (arm, ms) in enumerate(step_ms.items())
    ]
    for repeat, (auto, none) in enumerate(zip(auto_ms, none_ms, strict=True)):
        base = {"repeat": repeat, "order": 0, "seconds": 30.0, "rc": 0}
        if repeat:  # repeat 0's none is above
            records.append({**base, "arm": "ds_mirrored", "step_ms": none, "mean_step_ms": none})
        records.append({**base, "arm": AUTO, "step_ms": auto, "mean_step_ms": auto + 3, "auto": _auto_reading()})
    records[0]["mean_step_ms"] = none_ms[0]
    settings = {k: v for k, v in vars(opts).items() if k not in ("out", "render")}
    arms = {**{n: n for n in STRATEGIES}, **{c: f"ds_mirrored {c}" for c in COMPRESSIONS}}
    arms[AUTO] = "ds_mirrored auto"
    return {"benchmark": "mirrored", "settings": settings, **Mirrored().meta(opts), "arms": arms, "records": records}


def test_render_of_a_gpt_result_reports_tokens_per_second_in_gpt_files(tmp_path: Path, capsys):
    pytest.importorskip("matplotlib")
    write_json(tmp_path / "mirrored_gpt.json", _gpt_data())
    harness.main(Mirrored(), ["--render", str(tmp_path / "mirrored_gpt.json")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mirrored_gpt.json", "mirrored_gpt.md", "mirrored_gpt.png"]
    md = (tmp_path / "mirrored_gpt.md").read_text()
    assert md.startswith("# ds_mirrored on the byte-level GPT (4 layers, d_model 128, 4 heads, context 128)")
    assert "| strategy | step (ms) | tokens/s |" in md
    # 2 processes x 8 windows x 128 tokens = 2048 tokens per step; at 100 ms, 20480 tokens/s
    assert "| ds_mirrored | 100.00 | 20480 |" in md
    assert "| **ds_mirrored / Lightning ddp (target <= 1.00)** | **0.800** |  |" in md
    assert "| powersgd | 0.875 MB | 0.250x | 110.00 | 18618 |" in md
    assert "| none | 3.500 MB | 1.000x | 100.00 | 20480 |" in md and "| bf16 |" not in md
    assert "samples/s" not in md
    # auto / none per repeat against 1.05; its mean step counts the probe steps; what auto chose, from its reading.
    assert "| median step (ms) | 104.00 | 100.00 | **1.040** | <= 1.05 | not judged |" in md  # 1 launch of 3
    assert "| mean step (ms), probe steps included | 107.00 | 100.00 | 1.070 | - | - |" in md
    assert "What auto chose: chose none in 1 of 1 runs (timed steps: none 10); probed latency 40 us/round," in md
    assert "bandwidth 2000 MB/s float32, 500 MB/s float16; first run's decisions: step 0: none (probed), step 10" in md


@pytest.mark.parametrize(
    ("auto_ms", "verdict", "row"),
    [
        ((110.0, 95.0, 120.0), "within noise", "| 110.00 [95.00 - 120.00] | 100.00 | **1.100 [0.950 - 1.200]** |"),
        ((110.0, 108.0, 120.0), "missed", "| 110.00 [108.00 - 120.00] | 100.00 | **1.100 [1.080 - 1.200]** |"),
        ((101.0, 104.0, 120.0), "met", "| 104.00 [101.00 - 120.00] | 100.00 | **1.040 [1.010 - 1.200]** |"),
    ],
)
def test_auto_over_none_is_paired_by_repeat_and_judged_by_the_median_and_spread(auto_ms, verdict, row):
    data = _gpt_data(auto_ms=auto_ms, none_ms=(100.0, 100.0, 100.0))
    s = Mirrored().summarise(data)[AUTO]["auto"]
    assert s["over_none"]["runs"] == pytest.approx([a / 100.0 for a in auto_ms]) and s["met"] is (verdict == "met")
    assert s["choices"]["final"] == {"none": 3} and s["choices"]["probes_in_timed_steps"]["median"] == 0
    md = "\n".join(Mirrored().report({**data, "summary": Mirrored().summarise(data)}))
    assert f"| median step (ms) {row} <= 1.05 | {verdict} |" in md


def test_render_of_the_digits_results_from_before_the_gpt_says_samples_per_second(tmp_path: Path):
    pytest.importorskip("matplotlib")
    source = RESULTS / "mirrored.json"
    if not source.exists():
        pytest.skip("no digits results in this checkout")
    data = json.loads(source.read_text())
    data["settings"].pop("model", None)  # as written before --model: must still read as the digits
    # A file written when the driver still ran bf16 lists it among its arms: it must still get its row.
    data["arms"]["bf16"] = "ds_mirrored bf16"
    data["records"] += [{**r, "arm": "bf16"} for r in data["records"] if r["arm"] == "fp16"]
    old = tmp_path / "old" / "mirrored.json"
    old.parent.mkdir()
    old.write_text(json.dumps(data))
    harness.main(Mirrored(), ["--render", str(old), "--out", str(tmp_path)])
    md = (tmp_path / "mirrored.md").read_text()
    assert md.startswith("# ds_mirrored on the digits MLP 64-1024-1024-10")
    assert "| strategy | step (ms) | samples/s |" in md
    assert "| fp16 | 2.253 MB | 0.500x |" in md  # the payload of fp16 is half of fp32's on any run
    assert "| bf16 | 2.253 MB | 0.500x |" in md
    first = min(harness.ok(data["records"], "ds_mirrored"), key=lambda r: r["repeat"])
    rate = 2 * data["settings"]["batch_size"] * 1000 / first["step_ms"]  # samples of the global batch per second
    assert (tmp_path / "mirrored.png").exists()
    assert Mirrored().summarise(data)["ds_mirrored"]["throughput"]["runs"][0] == pytest.approx(rate)
