"""The collectives benchmark: its round order, ring model and reading by hand, its page from synthetic readings, and
one ``--quick`` run on two real gloo processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness
from benchmarks.collectives.driver import SIZES, Collectives, arm_name, reading_of, ring_bytes, size_of
from benchmarks.collectives.worker import OPS, padded, rounds, slowest
from benchmarks.harness.writers import write_json


def test_sizes_are_the_workloads_parameter_counts():
    assert SIZES == {"digits": 1_126_410, "gpt": 875_520, "10M": 10_000_000}
    assert size_of("gpt") == 875_520 and size_of("1000") == 1000
    with pytest.raises(SystemExit, match="--sizes huge: give one of"):
        size_of("huge")


def test_padding_and_rotating_rounds():
    assert padded(1_126_410, 2) == 1_126_410 and padded(1_126_410, 4) == 1_126_412
    assert rounds(("a", "b", "c"), 4) == [["a", "b", "c"], ["c", "b", "a"], ["b", "c", "a"], ["a", "c", "b"]]


def test_slowest_takes_each_rounds_largest_time_over_the_ranks():
    per_rank = [{"x": [1.0, 5.0], "y": [2.0, 2.0]}, {"x": [3.0, 4.0], "y": [1.0, 6.0]}]
    assert slowest(per_rank) == {"x": [3.0, 5.0], "y": [2.0, 6.0]}


def test_ring_model_by_hand():
    # 1,000 fp32 elements (4,000 bytes) on 4 ranks: an all-reduce sends 2 * 3/4 of them, a reduce-scatter 3/4
    assert ring_bytes("all_reduce", 1000, 4) == 6000 == ring_bytes("rs_ag", 1000, 4)
    assert ring_bytes("reduce_scatter", 1000, 4) == 3000 == ring_bytes("all_gather", 1000, 4)
    assert ring_bytes("all_reduce", 1000, 2) == 4000


def _result(procs: int, numel: int, ms: dict[str, float]) -> dict[str, Any]:
    # the middle round is the op's time; the others straddle it, so the median picks it
    return {"procs": procs, "numel": numel, "threads": 1, "ms": {op: [t * 0.5, t, t * 3] for op, t in ms.items()}}


GLOO = {"all_reduce": 4.0, "reduce_scatter": 8.0, "all_gather": 2.0, "rs_ag": 10.0}  # like gloo: RS 2x AR
RING = {"all_reduce": 4.0, "reduce_scatter": 2.0, "all_gather": 2.0, "rs_ag": 4.0}  # what a ring model says


def test_reading_takes_medians_and_ratios_within_the_run():
    reading = reading_of(_result(2, 1_000_000, GLOO))
    assert reading["all_reduce_ms"] == 4.0 and reading["rs_ag_ms"] == 10.0
    assert reading["rs_over_ar"] == 2.0 and reading["ag_over_ar"] == 0.5 and reading["rsag_over_ar"] == 2.5
    assert reading["rsag_extra_ms"] == 6.0
    # 4 MB all-reduced on 2 ranks: 4 MB sent per rank in 4 ms is 1,000 MB/s; the reduce-scatter's 2 MB in 8 ms
    assert reading["all_reduce_mbps"] == pytest.approx(1000.0)
    assert reading["reduce_scatter_mbps"] == pytest.approx(250.0)


def _render(tmp_path: Path, times: dict[str, float], sizes: list[str], procs: list[int]) -> str:
    bench = Collectives()
    settings = {"procs": procs, "sizes": sizes, "iters": 20, "warmup": 3, "repeats": 2, "quick": False}
    arms, records = {}, []
    for n in procs:
        for size in sizes:
            arm = arm_name(size, n)
            arms[arm] = f"{size}, {n} procs"
            for rep, scale in enumerate((1.0, 1.2)):
                ms = {op: t * scale for op, t in times.items()}
                records.append(
                    {"arm": arm, "repeat": rep, "rc": 0, **reading_of(_result(n, padded(size_of(size), n), ms))}
                )
    records.append({"arm": arm_name(sizes[0], procs[0]), "repeat": 2, "error": "timed out after 300 s"})
    data = {"benchmark": "collectives", "settings": settings, "torch": "2.x", "cpus": 2, "arms": arms}
    write_json(tmp_path / "collectives.json", {**data, "records": records})
    harness.main(bench, ["--render", str(tmp_path / "collectives.json")])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"collectives.{x}" for x in ("json", "md", "png")]
    return (tmp_path / "collectives.md").read_text()


def test_page_from_gloo_like_readings_says_fsdp2_pays_for_the_collectives(tmp_path: Path):
    pytest.importorskip("matplotlib")
    md = _render(tmp_path, GLOO, ["digits", "1000"], [2, 4])
    assert md.startswith("# Gloo collectives: reduce-scatter and all-gather against all-reduce")
    # the repeats scale every time by 1 and 1.2: medians 1.1x, spreads [1 - 1.2]x; the ratios are the same in both
    row = "| digits, 4 procs | 1,126,412 | 4.40 [4.00 - 4.80] | 8.80 [8.00 - 9.60] | 2.20 [2.00 - 2.40] |"
    ratios = "2.00 | 0.50 | 2.50"
    assert f"{row} 11.00 [10.00 - 12.00] | {ratios} | 6.60 [6.00 - 7.20] |" in md
    assert "| 1000, 2 procs | 1,000 |" in md
    assert "| digits, 2 procs | 4.51 / 2.25 / 2.25 / 4.51 |" in md
    assert "gloo's reduce-scatter takes 2.00x its all-reduce's time (ring model: 0.50x)" in md
    assert "FSDP2's pair 2.50x (ring model: 1.00x)" in md and "fsdp2 pays for how gloo runs" in md
    assert "- digits_p2: timed out after 300 s" in md


def test_page_from_ring_like_readings_does_not_blame_the_collectives(tmp_path: Path):
    pytest.importorskip("matplotlib")
    md = _render(tmp_path, RING, ["gpt"], [2])
    assert "| gpt, 2 procs | 875,520 |" in md
    assert "reduce-scatter takes 0.50x" in md and "FSDP2's pair 1.00x" in md
    assert "the collectives alone do not explain fsdp2's slower steps" in md


@pytest.mark.multiprocess
def test_quick_run_on_two_gloo_processes(tmp_path: Path):
    data = harness.main(Collectives(), ["--quick", "--procs", "2", "--sizes", "1000", "--out", str(tmp_path)])
    (record,) = data["records"]
    assert "error" not in record, record
    assert record["procs"] == 2 and record["numel"] == 1000 and record["threads"] == 1
    assert all(record[f"{op}_ms"] > 0 for op in OPS)
    assert json.loads((tmp_path / "collectives.json").read_text())["settings"]["iters"] == 3
    assert "| 1000, 2 procs | 1,000 |" in (tmp_path / "collectives.md").read_text()
