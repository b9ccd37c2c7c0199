"""The cluster benchmark's part 4 (two-level all-reduce vs the flat ring): its reading, pairing and report."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks.cluster.hierarchical import (
    hierarchical_markdown,
    hierarchical_verdicts,
    merge_hierarchical,
    summarise_hierarchical,
)


def _rank(local_rank: int, tx: int | None, steps: list[float]) -> dict[str, Any]:
    return {"local_rank": local_rank, "tx_timed_bytes": tx, "step_ms": steps, "param_checksum": 1.0}


def test_a_runs_bytes_are_both_hosts_veth_bytes_over_the_timed_steps():
    ranks = {
        0: _rank(0, 3_000, [900.0, 100.0, 30.0, 10.0, 20.0]),
        1: _rank(1, None, [900.0, 1.0, 1.0, 1.0, 1.0]),  # not a host's leader: reads no counter
        2: _rank(0, 5_000, [900.0, 1.0, 1.0, 1.0, 1.0]),
        3: _rank(1, None, [900.0, 1.0, 1.0, 1.0, 1.0]),
    }
    reading = merge_hierarchical(ranks, warmup=1)
    assert reading["steps"] == 4
    assert reading["step_ms"] == pytest.approx(25.0)  # rank 0's median over its timed steps only
    assert reading["inter_host_bytes_per_step"] == pytest.approx(8_000 / 4)
    assert reading["hosts"] == 2


def _run(repeat: int, step_ms: float, mb: float, diff: float | None = None) -> dict[str, Any]:
    run = {"repeat": repeat, "step_ms": step_ms, "inter_host_bytes_per_step": mb * 1e6}
    if diff is not None:
        run["max_abs_diff_vs_flat"] = diff
    return run


def test_ratios_are_paired_by_repeat_and_judged_against_the_targets():
    raw = {
        "flat": [_run(0, 300.0, 6.0), _run(1, 600.0, 6.0), _run(2, 400.0, 6.0)],
        "two_level": [_run(1, 300.0, 4.5, 2e-7), _run(0, 150.0, 2.4, 1e-6), _run(2, 200.0, 3.6)],
        "flat_fp16": [_run(0, 200.0, 3.0)],
        "two_level_fp16": [{"repeat": 0, "error": "timed out"}],
    }
    summary = summarise_hierarchical(raw)
    pair = summary["pairs"]["two_level/flat"]
    # Repeat 0: 150 vs 300 ms, 2.4 vs 6 MB; repeat 1: 300 vs 600 ms, 4.5 vs 6 MB; repeat 2: 200 vs 400 ms, 3.6 vs 6 MB
    # (not crossed between repeats).
    assert pair["speedup"]["runs"] == [2.0, 2.0, 2.0]
    assert sorted(pair["bytes_ratio"]["runs"]) == pytest.approx([0.4, 0.6, 0.75])
    assert pair["bytes_met"] is False  # the median, 0.6, is above 0.55; its spread reaches below: within noise
    assert pair["speedup_met"] is True
    assert pair["max_abs_diff"] == 1e-6 and pair["parity_met"] is True
    failed = summary["pairs"]["two_level_fp16/flat_fp16"]
    assert failed["speedup"] is None and failed["speedup_met"] is None and failed["parity_met"] is None
    assert summary["configs"]["two_level_fp16"]["failed"] == 1
    text = "\n".join(hierarchical_markdown(summary, {"hier_rate": 100.0, "hier_hidden": [1024, 1024]}))
    row = "| two_level | 200.0 [150.0 - 300.0] | 3.60 [2.40 - 4.50] | 0.600 [0.400 - 0.750] | 2.000 |"
    assert row in text
    judged = {v["what"]: v for v in hierarchical_verdicts(summary)}  # the page's Verdicts section
    assert judged["two_level/flat: inter-host bytes per step"]["verdict"] == "within noise"
    assert judged["two_level/flat: step-time speed-up"]["verdict"] == "met"
    # Only two repeats carry a parameter difference: fewer than 3 launches, not judged.
    assert judged["two_level/flat: final parameters, largest difference"]["verdict"] == "not judged"
    assert judged["two_level_fp16/flat_fp16: inter-host bytes per step"]["verdict"] == "no data"
    assert summary["pairs"]["two_level_fp16/flat"]["max_abs_diff"] is None  # other gradients: no parity to judge


def test_the_gpt_run_names_its_workload_and_writes_its_own_files():
    from benchmarks.cluster.driver import Cluster
    from benchmarks.cluster.hierarchical import hierarchical_spec

    gpt = {"model": "gpt", "gpt_layers": 4, "gpt_heads": 4, "gpt_width": 128, "gpt_block": 128}
    heading = hierarchical_markdown({"configs": {}, "pairs": {}}, {"hier_rate": 100.0, "hier_hidden": [8], **gpt})[1]
    assert "byte-level GPT (4 layers, d_model 128, 4 heads, context 128)" in heading and "AdamW lr 0.001" in heading
    digits = hierarchical_markdown({"configs": {}, "pairs": {}}, {"hier_rate": 100.0, "hier_hidden": [8]})[1]
    assert "digits MLP 64-8-10" in digits
    assert Cluster().file_stem({"parts": ["hierarchical"], **gpt}) == "cluster_hierarchical_gpt"
    assert Cluster().file_stem({"parts": ["hierarchical"], "model": "digits"}) == "cluster_hierarchical"

    class Host:
        interface = "eth0"

    class Hosts:
        hosts = [Host()]

    opts = argparse.Namespace(hier_hidden=[8], hier_steps=2, hier_warmup=1, dist_timeout=5, val_windows=4, **gpt)
    spec = hierarchical_spec(opts, Hosts(), "/tmp")  # type: ignore[arg-type]
    assert spec["workload"] == {"model": "gpt", "n_layer": 4, "n_head": 4, "d_model": 128, "block_size": 128}
    assert (spec["lr"], spec["batch_size"]) == (1e-3, 8)
    assert hierarchical_spec(argparse.Namespace(**{**vars(opts), "model": "digits"}), Hosts(), "/tmp")["lr"] == 0.05
