"""The straggler benchmark: per-model defaults, a fabricated GPT result rendered, the validation windows."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.parameter_server import worker
from benchmarks.parameter_server.driver import PHASES, ParameterServer, reading, unit


def per_model(argv: list[str]) -> argparse.Namespace:
    bench = ParameterServer()
    opts = harness.cli.resolve(bench, harness.cli.parser(bench).parse_args(argv))
    bench.meta(opts)
    return opts


def test_per_model_defaults_fill_only_what_is_left_none():
    digits = per_model([])
    assert (digits.steps, digits.batch, digits.lr, digits.eval_every, digits.val_windows) == (120, 32, 0.05, 10, 16)
    gpt = per_model(["--model", "gpt"])
    assert (gpt.steps, gpt.batch, gpt.lr, gpt.eval_every) == (12, 8, 1e-3, 4)
    quick = per_model(["--model", "gpt", "--quick"])
    assert (quick.steps, quick.batch, quick.eval_every) == (6, 8, 3)
    given = per_model(["--model", "gpt", "--steps", "7", "--batch", "3"])
    assert (given.steps, given.batch) == (7, 3)


def test_unit_is_tokens_of_the_context_for_the_gpt():
    assert unit({"model": "gpt", "gpt_block": 64}) == ("tokens", 64)
    assert unit({"model": "digits"}) == ("samples", 1)
    assert unit({}) == ("samples", 1)


def _rank(steps: int, step_ms: float, ppl: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "steps": steps,
        "samples": 8 * steps,
        "first_start": 0.0,
        "last_end": 10.0,
        "median_step_ms": step_ms,
        "median_busy_ms": step_ms / 3,
        "phase_ms": dict.fromkeys(PHASES, step_ms / 4),
    }
    if ppl is not None:
        out.update(curve=[[0, 256.0], [16 * steps, ppl]], final_ppl=ppl, eval_s=0.1)
    return out


def _record(arm: str, repeat: int, fast_steps: int, ppl: float) -> dict[str, Any]:
    found = {"rc": 0, "result.0": _rank(fast_steps, 100.0, ppl), "result.1": _rank(10, 300.0, None)}
    return {"arm": arm, "repeat": repeat, **reading(found)}


def test_render_of_a_gpt_result_in_tokens_per_second(tmp_path: Path):
    bench = ParameterServer()
    arms = {a.name: a.title for a in bench.experiment(argparse.Namespace(repeats=1)).arms}
    # ds_mirrored: 10 + 10 steps of 8 windows in 10 s; async: 30 + 10 steps, at a perplexity 1.02x ds_mirrored's.
    steps = {"ds_mirrored": 10, "ps_async": 30, "ps_staleness_4": 20, "ps_staleness_0": 10}
    ppl = {"ds_mirrored": 20.0, "ps_async": 20.4, "ps_staleness_4": 22.0, "ps_staleness_0": 20.0}
    records = [
        _record(a, rep, steps[a.removeprefix("no_straggler/")], ppl[a.removeprefix("no_straggler/")])
        for rep in range(3)
        for a in arms
    ]
    settings = {"repeats": 3, "model": "gpt", "gpt_block": 128, "steps": 10, "batch": 8, "lr": 1e-3}
    data = {
        "benchmark": "parameter_server",
        "settings": {**settings, "slowdown": 3.0, "val_windows": 32},
        "workload": "byte-level GPT (4 layers)",
        "package": {"commit": "0123456789abcdef", "uncommitted": []},
        "calibration": {"delay_ms_per_sample": 1.0, "delay_ms_per_step": 8.0, "undelayed_step_ms": 4.0},
        "arms": arms,
        "baseline": None,
        "records": records,
    }
    harness.write_json(tmp_path / "parameter_server_gpt.json", data)
    harness.main(bench, ["--render", str(tmp_path / "parameter_server_gpt.json"), "--model", "gpt"])
    md = (tmp_path / "parameter_server_gpt.md").read_text()
    assert "byte-level GPT (4 layers)" in md
    assert "tokens/s" in md and "samples/s" not in md
    # 20 steps x 8 windows x 128 tokens in 10 s = 2048 tokens/s; async 40 steps: 4096 tokens/s, 2.00x.
    assert "| ds_parameter_server max_staleness=None | 4096 | 2.00 | 20.40 | 1.020 |" in md
    assert "| ds_mirrored | 2048 | - | 20.00 | - |" in md
    assert "| async throughput vs ds_mirrored under the straggler | >= 1.50x | 2 | 3 | met |" in md
    assert "max_staleness=4 vs ds_mirrored at equal tokens | <= 1.05x | 1.1 | 3 | missed |" in md
    assert "| max_staleness=0 step time vs ds_mirrored, no straggler | <= 1.30x | 1 | 3 | met |" in md
    assert "on the first 32 validation windows" in md
    assert (tmp_path / "parameter_server_gpt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "parameter_server.md").exists()


def test_worker_judges_the_gpt_on_the_same_first_validation_windows():
    spec = {"workload": {"model": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 16}}
    spec.update(seed=0, lr=1e-3, val_windows=4, batch_size=2)
    model, train_set, (x, y), metric = worker.make_model(spec)
    again = worker.make_model(spec)[2]
    assert metric == "ppl" and isinstance(model, worker.TimedWorkload) and len(train_set) > 0
    assert x.shape == y.shape == (4, 16) and torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte
    evaluator = worker.Evaluator(1, (x, y), samples_per_update=2, metric="ppl")
    assert 100 < evaluator.evaluate(model) < 600  # an untrained byte model: about the 256 of a uniform guess
    digits = worker.make_model({"batch_size": 32, "hidden": [128], "lr": 0.05, "seed": 0})
    assert digits[3] == "acc" and isinstance(digits[0], worker.TimedClassifier)
