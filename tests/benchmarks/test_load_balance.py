"""The load-balance benchmark: per-model defaults, a fabricated GPT result rendered, the worker's validation windows."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.load_balance import worker
from benchmarks.load_balance.driver import LoadBalance, per_model, reading


def _opts(argv: list[str]) -> argparse.Namespace:
    bench = LoadBalance()
    return harness.cli.resolve(bench, harness.cli.parser(bench).parse_args(argv))


def test_per_model_defaults_fill_only_what_is_left_none():
    digits = per_model(_opts([]))
    assert (digits.epochs, digits.warmup_epochs, digits.global_batch, digits.lr) == (10, 3, 512, 0.05)
    assert digits.limit_train_batches is None
    gpt = per_model(_opts(["--model", "gpt"]))
    assert (gpt.epochs, gpt.warmup_epochs, gpt.global_batch, gpt.lr, gpt.limit_train_batches) == (3, 2, 16, 1e-3, 8)
    quick = per_model(_opts(["--model", "gpt", "--quick"]))
    assert (quick.epochs, quick.warmup_epochs, quick.limit_train_batches) == (1, 1, 6)
    given = per_model(_opts(["--model", "gpt", "--global-batch", "24", "--warmup-epochs", "0"]))
    assert (given.global_batch, given.warmup_epochs) == (24, 0)


def _rank(step_ms: float, sizes: list[int], ppl: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "epoch_s": [2 * step_ms / 1000] * 3,
        "step_ms": [step_ms] * 6,
        "compute_ms": [step_ms] * 6,
        "local_sizes": [sizes[0]] * 6,
    }
    if ppl is not None:
        out.update(sizes=[sizes] * 6, final_sizes=sizes, estimate=[2.0, 1.0], final_ppl=ppl)
    return out


def _record(arm: str, step_ms: float, sizes: list[int], ppl: float, repeat: int = 0) -> dict[str, Any]:
    found = {"rc": 0, "result.0": _rank(step_ms, sizes, ppl), "result.1": _rank(step_ms, sizes[::-1], None)}
    return {"arm": arm, "repeat": repeat, **reading(found, 1)}


def test_render_of_a_gpt_result_in_tokens_per_second(tmp_path: Path):
    st = {"repeats": 3, "model": "gpt", "gpt_block": 128, "gpt_layers": 4, "gpt_heads": 4, "gpt_width": 128}
    st.update(epochs=2, warmup_epochs=1, global_batch=16, lr=1e-3, limit_train_batches=2, interval=3, slowdown=2.0)
    data = {
        "benchmark": "load_balance",
        "settings": {**st, "hidden": [1024, 1024], "val_windows": 32},
        "workload": "byte-level GPT (4 layers)",
        "package": {"commit": "0123456789abcdef", "uncommitted": []},
        "calibration": {"delay_ms_per_sample": 5.0, "undelayed_compute_ms_per_sample": 5.0},
        "arms": {"equal": "equal split (interval=0)", "balanced": "DynamicLoadBalancer"},
        "baseline": "equal",
        # 16 windows x 128 tokens per step: 2048 tokens in 200 ms (equal) or 140 ms (balanced).
        "records": [
            r
            for rep in range(3)
            for r in (_record("equal", 200.0, [8, 8], 30.0, rep), _record("balanced", 140.0, [11, 5], 30.3, rep))
        ],
    }
    harness.write_json(tmp_path / "load_balance_gpt.json", data)
    harness.main(LoadBalance(), ["--render", str(tmp_path / "load_balance_gpt.json"), "--model", "gpt"])
    md = (tmp_path / "load_balance_gpt.md").read_text()
    assert "byte-level GPT (4 layers)" in md and "16 windows of 128 tokens" in md
    assert "| [11, 5], [11, 5], [11, 5] | 14629 | 30.30 |" in md  # 2048 / 0.14 s, every repeat
    assert "| [8, 8], [8, 8], [8, 8] | 10240 | 30.00 |" in md
    assert "| final val perplexity (ratio) | 1.010 |" in md
    # the target once, in the harness's Verdicts section
    assert "| epoch time with DynamicLoadBalancer vs equal split (ideal 0.667x) | <= 0.75x | 0.7 | 3 | met |" in md
    assert md.count("epoch time with DynamicLoadBalancer vs equal split") == 1
    assert "final val acc" not in md
    assert (tmp_path / "load_balance_gpt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worker_judges_the_gpt_by_perplexity_on_the_first_validation_windows():
    spec = {"workload": {"model": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 16}}
    spec.update(seed=0, lr=1e-3, val_windows=4, global_batch_size=4, slow_rank=1, delay_per_sample=0.0)
    model, train_set, (x, y), metric = worker.make_model(spec)
    assert metric == "ppl" and isinstance(model, worker.SlowWorkload) and len(train_set) > 0
    assert (model.slow_rank, model.delay_per_sample) == (1, 0.0)  # the straggler's, from the spec
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, worker.make_model(spec)[2][0])
    assert 100 < worker.evaluate(model, (x, y), metric) < 600  # untrained: about the 256 of a uniform guess
    digits = worker.make_model({**spec, "workload": {"model": "digits"}, "hidden": [16], "lr": 0.05})
    assert digits[3] == "acc" and isinstance(digits[0], worker.SlowClassifier)
    assert 0.0 <= worker.evaluate(digits[0], digits[2], "acc") <= 1.0
