"""The pipeline benchmark: its per-model defaults, the GPT's stage split, a render of fabricated GPT records, and one
real launch of each implementation on a tiny GPT (2 gloo processes)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import harness
from benchmarks.harness.cli import parser, resolve
from benchmarks.pipeline import worker
from benchmarks.pipeline.driver import Pipeline, config_key, run_launches

TINY_GPT = {"model": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 16}


def _opts(*argv: str) -> Any:
    bench = Pipeline()
    opts = resolve(bench, parser(bench).parse_args(["--out", "unused", *argv]))
    bench.meta(opts)
    return opts


def test_defaults_depend_on_the_model_and_quick():
    digits = _opts()
    assert (digits.steps, digits.warmup, digits.ms, digits.batch, digits.procs) == (20, 5, [2, 8], 128, [2, 4])
    gpt = _opts("--model", "gpt")
    assert (gpt.steps, gpt.warmup, gpt.ms, gpt.batch, gpt.procs) == (6, 4, [2, 8], 8, [2, 4])
    quick = _opts("--model", "gpt", "--quick")
    assert (quick.steps, quick.warmup, quick.ms, quick.batch, quick.procs) == (3, 3, [2, 4], 8, [2])
    given = _opts("--model", "gpt", "--steps", "7", "--ms", "4", "2", "--batch", "16")
    assert (given.steps, given.ms, given.batch) == (7, [2, 4], 16)


def test_refuses_a_split_that_does_not_divide():
    with pytest.raises(SystemExit, match="divide the model's 4 blocks"):
        _opts("--model", "gpt", "--procs", "3")
    with pytest.raises(SystemExit, match="batch of 8 rows"):
        _opts("--model", "gpt", "--ms", "16")
    with pytest.raises(SystemExit, match="divide the model's 6 blocks"):
        _opts("--model", "gpt", "--gpt-layers", "6", "--procs", "4")


def test_gpt_stages_chain_to_the_whole_net_from_token_ids():
    spec = {"seed": 0, "batch": 4, "workload": TINY_GPT}
    assert worker.stage_balance(spec, 2) == [2, 3]  # embedding + block | block + norm + head
    assert worker.stage_balance({**spec, "workload": {**TINY_GPT, "n_layer": 4}}, 4) == [2, 1, 1, 3]
    assert worker.stage_balance({"seed": 0, "batch": 4}, 4) == [2, 2, 2, 2]
    net = worker.make_net(spec)
    x, y = worker.batches(spec)[0]
    assert x.dtype == torch.int64 and x.shape == (4, 16) and y.shape == (4, 16)
    out = x
    for stage in range(2):
        out = worker.stage_blocks(net, stage, 2, spec)(out)
    torch.testing.assert_close(out, net(x))
    assert worker.sample_input(spec, 0, 2).dtype == torch.int64
    assert worker.sample_input(spec, 1, 2).shape == (2, 16, 32)
    # Half the rows per micro-batch, half the saved activations.
    assert worker.unit_bytes(spec, 1, 2, 2) == 2 * worker.unit_bytes(spec, 1, 2, 4) > 0


def _config(step_ms: float, peaks: list[int], unit: int, cpu_ms: float | None = None) -> dict[str, Any]:
    return {
        "cpu_ms": cpu_ms,
        "median_step_ms": step_ms,
        "step_ms": [step_ms],
        "peak_bytes": {str(s): b for s, b in enumerate(peaks)},
        "unit_bytes": {str(s): unit for s in range(len(peaks))},
        "spans": [],
    }


def test_render_of_a_gpt_result_says_tokens_per_second(tmp_path: Path):
    mb = 2**20
    records = []
    for repeat in range(3):
        records += [
            {
                "arm": "single",
                "repeat": repeat,
                "configs": {config_key("single", 1, "seq", 1): _config(200, [8 * mb], 8 * mb, cpu_ms=190)},
            },
            {
                "arm": "hand p=2",
                "repeat": repeat,
                "configs": {config_key("hand", 2, "GPipe", 1): _config(125, [2 * mb, 3 * mb], 2 * mb, cpu_ms=210)},
            },
            {
                "arm": "lightning p=2",
                "repeat": repeat,
                "configs": {config_key("lightning", 2, "GPipe", 1): _config(110, [2 * mb, 3 * mb], 2 * mb, cpu_ms=220)},
            },
            {
                "arm": "ds p=2",
                "repeat": repeat,
                "configs": {config_key("ds", 2, "GPipe", 1): _config(100, [2 * mb, 3 * mb], 2 * mb, cpu_ms=230)},
            },
        ]
    settings = {"model": "gpt", "procs": [2], "ms": [1], "batch": 8, "steps": 10, "warmup": 4, "repeats": 3}
    settings.update(trace_steps=3, gpt_layers=4, gpt_heads=4, gpt_width=128, gpt_block=128)
    data = {"benchmark": "pipeline", "settings": settings, "records": records, "cpus": 2, "seconds": 60}
    harness.write_json(tmp_path / "pipeline_gpt.json", data)
    harness.main(Pipeline(), ["--render", str(tmp_path / "pipeline_gpt.json")])
    md = (tmp_path / "pipeline_gpt.md").read_text()
    assert "byte-level GPT (4 layers, d_model 128, 4 heads, context 128)" in md
    assert "1,024 tokens per step" in md
    assert "5,120 tokens/s" in md  # single process: 8 x 128 tokens in 200 ms
    # ds 100 ms / hand 125 ms, and / the same loop in Lightning 110 ms
    assert "| 2 | GPipe | 1 | 200.0 | 125.0 | 110.0 | 100.0 | **0.800** met | **0.909** met |" in md
    assert "| 2 | GPipe | 1 | 2.00 / 3.00 | 1.00 / 1.50 | 1.00 / 1.50 | 1 / 1 |" in md
    # CPU per step, ranks summed: ds - hand = +20 ms, ds - in Lightning = +10 ms
    assert "single process, whole batch: 190.0 ms." in md
    assert "| 2 | GPipe | 1 | 210.0 | 220.0 | 230.0 | +20.0 | +10.0 |" in md
    assert (tmp_path / "pipeline_gpt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "pipeline.md").exists() and not (tmp_path / "pipeline.png").exists()
    summary = json.loads(json.dumps(Pipeline().summarise(data)))
    assert summary["meta"]["unit"] == "tokens" and summary["meta"]["per_step"] == 1024


@pytest.mark.multiprocess
@pytest.mark.parametrize("impl", ["hand", "lightning", "ds"])
def test_tiny_gpt_runs_both_schedules_with_activations_per_stage(impl: str, tmp_path: Path):
    opts = _opts(
        "--model",
        "gpt",
        "--procs",
        "2",
        "--gpt-layers",
        "2",
        "--gpt-heads",
        "2",
        "--gpt-width",
        "32",
        "--gpt-block",
        "16",
    )
    opts.steps, opts.warmup, opts.trace_steps, opts.batch, opts.timeout = 1, 2, 1, 4, 240.0  # under pytest's 300 s
    configs = [{"schedule": s, "m": 2, "key": config_key(impl, 2, s, 2)} for s in ("GPipe", "1F1B")]
    results = run_launches(impl, 2, configs, opts)
    for schedule, expected in (("GPipe", [2, 2]), ("1F1B", [2, 1])):
        result = results[config_key(impl, 2, schedule, 2)]
        assert "error" not in result, result
        assert result["median_step_ms"] > 0
        assert result["cpu_ms"] > 0  # both ranks' CPU per timed step, summed
        units = [result["peak_bytes"][str(s)] / result["unit_bytes"][str(s)] for s in range(2)]
        assert units == pytest.approx(expected), (schedule, units)


def _spans(shift: int) -> list[list[Any]]:
    """Two ranks' forward and backward of one micro-batch in one step: rank 1 idles while rank 0 works, and back."""
    ms = 1_000_000
    return [
        [0, 0, "forward", 0, 1, 0, 10 * ms],
        [1, 1, "forward", 0, 1, 10 * ms, (20 + shift) * ms],
        [1, 1, "backward", 0, 1, (20 + shift) * ms, (40 + shift) * ms],
        [0, 0, "backward", 0, 1, (40 + shift) * ms, (60 + shift) * ms],
    ]


def test_compaction_keeps_the_summary_and_only_the_traced_runs_spans():
    """Step times become quantiles, spans a bubble figure; the summary from the compact records is the same, and the
    last good run of the traced configuration keeps its spans (``--render`` draws the traces from it)."""
    traced, other = config_key("ds", 2, "GPipe", 2), config_key("ds", 2, "GPipe", 1)  # m=2: the largest m traced
    records = []
    for repeat in range(3):
        configs = {}
        for key in (traced, other):
            cfg = _config(100.0 + repeat, [2**20, 2**20], 2**20)
            cfg.update(step_ms=[100.0 + repeat + i for i in range(20)], spans=_spans(repeat))
            configs[key] = cfg
        records.append({"arm": "ds p=2", "repeat": repeat, "configs": configs})
    settings = {"model": "digits", "procs": [2], "ms": [1, 2], "batch": 128, "repeats": 3}
    data = {"benchmark": "pipeline", "settings": settings, "records": records}
    before = Pipeline().summarise(copy.deepcopy(data))
    compact = Pipeline().compact(copy.deepcopy(data))
    assert json.loads(json.dumps(Pipeline().summarise(compact))) == json.loads(json.dumps(before))
    assert before["configs"][0]["ds"]["bubble"]["runs"][0] == pytest.approx(0.5)  # 30 of 60 ms idle per rank
    runs = [r["configs"] for r in compact["records"]]
    assert all(r[other]["step_ms"]["n"] == 20 and "spans" not in r[other] for r in runs)
    assert ["spans" in r[traced] for r in runs] == [False, False, True]
    assert all(r[traced]["bubble"] is not None for r in runs)
