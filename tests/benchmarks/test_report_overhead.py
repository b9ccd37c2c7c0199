"""The report-overhead benchmark's reading and page, on synthetic records (nothing runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks.report_overhead.driver import ReportOverhead, reading


def _rank(wall: float, end: float, verdict: str | None = None) -> dict:
    return {"wall_ms_per_step": wall, "median_step_ms": wall - 1, "end_of_fit_s": end, "verdict": verdict}


def test_reading_takes_rank_0s_step_and_the_slower_ranks_end_of_fit():
    r = reading({"rc": 0, "result.0": _rank(20.0, 0.5, "balanced"), "result.1": _rank(21.0, 0.9)})
    assert (r["wall_ms_per_step"], r["median_step_ms"], r["end_of_fit_s"], r["verdict"]) == (
        20.0,
        19.0,
        0.9,
        "balanced",
    )
    with pytest.raises(harness.Failed, match="only"):
        reading({"rc": 1, "result.0": _rank(20.0, 0.5)})


def test_the_page_judges_the_per_repeat_ratio(tmp_path: Path):
    records = []
    for rep, (plain, report) in enumerate([(20.0, 20.2), (21.0, 21.1), (19.0, 19.9)]):
        records.append({"arm": "plain", "repeat": rep, **_rank(plain, 0.1)})
        records.append({"arm": "report", "repeat": rep, **_rank(report, 0.4, "balanced")})
    data = {
        "benchmark": "report_overhead",
        "settings": {"repeats": 3, "steps": 400, "warmup_steps": 20, "every_n_steps": 50},
        "workload": "w",
        "arms": {"plain": "no callback", "report": "DistributedReport"},
        "records": records,
    }
    harness.write_json(tmp_path / "report_overhead.json", data)
    harness.main(ReportOverhead(), ["--render", str(tmp_path / "report_overhead.json")])
    (verdict,) = ReportOverhead().summarise(data)["verdicts"]
    assert verdict["verdict"] == "met" and verdict["median"] == pytest.approx(20.2 / 20.0)  # the median ratio
    assert "wall ms / step" in (tmp_path / "report_overhead.md").read_text()
