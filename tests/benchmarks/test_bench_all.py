"""``make bench-all``: the targets it runs, the summary it writes, and the uniform verdicts every results file gives."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness
from benchmarks.harness import bench_all

KEYS = {"what", "target", "median", "min", "max", "launches", "verdict"}


def test_every_bench_target_of_the_makefile_names_the_results_it_writes():
    assert bench_all.bench_targets() == list(bench_all.WRITES)
    written = [stem for stems in bench_all.WRITES.values() for stem in stems]
    assert len(written) == len(set(written))


def test_the_docs_read_only_results_that_bench_all_writes():
    """Every ``result("<stem>", ...)`` in the docs names a file some bench-all target rewrites (or the summary)."""
    import re

    written = {stem for stems in bench_all.WRITES.values() for stem in stems} | {bench_all.NAME}
    repo = Path(__file__).resolve().parents[2]
    pages = [*sorted((repo / "docs").rglob("*.md")), repo / "README.md"]
    named = {m for page in pages for m in re.findall(r'(?:result|ratio|provenance)\("([\w.]+)"', page.read_text())}
    assert named and named <= written, sorted(named - written)


@pytest.mark.parametrize("path", sorted(p for p in harness.RESULTS.glob("*.json") if "_trace_" not in p.stem))
def test_every_results_file_lists_its_verdicts_in_one_shape(path: Path):
    data = json.loads(path.read_text())
    if path.stem == bench_all.NAME:
        assert {v["benchmark"] for v in data["verdicts"]} <= set(bench_all.load(harness.RESULTS))
        return
    verdicts, _ = bench_all.verdicts_of(data)
    assert all(set(v) == KEYS and v["verdict"] in harness.VERDICTS for v in verdicts)
    assert (data["benchmark"] == "collectives") == (not verdicts)  # the one benchmark without a target


def _result(folder: Path, stem: str, commit: str, repeats: int = 3, quick: bool = False, **extra: Any) -> None:
    verdicts = [harness.judged(f"{stem} ratio", harness.spread([1.0, 1.1, 1.2][:repeats]), at_most=1.05, unit="x")]
    data = {
        "benchmark": stem.removesuffix("_gpt"),
        "started": "2026-01-01T00:00:00+00:00",
        "settings": {"repeats": repeats, "quick": quick},
        "package": {"commit": commit, "uncommitted": []},
        "seconds": 600.0,
        "summary": {"verdicts": verdicts},
        **extra,
    }
    harness.write_json(folder / f"{stem}.json", data)


def test_summary_flags_mixed_commits_few_launches_and_the_budget(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(bench_all, "package_state", lambda: {"commit": "a" * 40, "uncommitted": []})
    _result(tmp_path, "mirrored", "a" * 40, repeats=5)
    _result(tmp_path, "pipeline", "a" * 40, repeats=5)  # its default
    _result(tmp_path, "precision", "b" * 40, repeats=1, quick=True)
    targets = ["bench-mirrored", "bench-pipeline", "bench-precision", "bench-precision-ops", "bench-collectives"]
    data = bench_all.build(targets, [], tmp_path)
    assert data["mode"] == "summary-only" and data["commits"]["one_commit"] == "no"
    assert [v["benchmark"] for v in data["verdicts"]] == ["mirrored", "pipeline", "precision"]
    assert data["counts"]["within noise"] == 2 and data["counts"]["not judged"] == 1 and data["counts"]["total"] == 3
    flags = {f["file"]: f["flags"] for f in data["files"]}
    assert flags["pipeline.json"] == []
    assert "5 launches per arm, not the default 3" in flags["mirrored.json"]
    assert {
        "commit unknown here: cannot tell whether the measured code changed since",
        "a --quick run",
        "1 launch(es) per arm, under 3: not judged",
    } <= set(flags["precision.json"])
    minutes = {r["target"]: r["estimated_minutes"] for r in data["targets"]}
    assert minutes["bench-mirrored"] == pytest.approx(6.0)  # 10 minutes at 5 launches, the default is 3
    assert minutes["bench-precision"] == pytest.approx(30.0)  # 1 launch recorded, 3 by default
    assert data["minutes"]["unknown"] == ["bench-precision-ops", "bench-collectives"]
    assert data["minutes"]["over_budget"] == "no"
    md = "\n".join(bench_all.markdown(data))
    assert "**NOT ONE RUN AT ONE COMMIT: the 3 results files come from 2 commit(s)" in md
    assert "3 targets: 0 met, 2 within noise, 0 missed, 1 not judged, 0 no data" in md
    assert "| precision | precision ratio | <= 1.05x | 1 | 1 | not judged |" in md


def test_a_run_goes_on_past_a_failed_target_and_flags_what_it_did_not_rewrite(tmp_path: Path, monkeypatch):
    calls = []

    def make(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        calls.append(cmd[-1])
        return subprocess.CompletedProcess(cmd, 2 if cmd[-1] == "bench-pipeline" else 0)

    monkeypatch.setattr(bench_all.subprocess, "run", make)
    monkeypatch.setattr(bench_all, "package_state", lambda: {"commit": "c" * 40, "uncommitted": []})
    monkeypatch.setattr(bench_all, "bench_targets", lambda: ["bench-mirrored", "bench-pipeline"])
    _result(tmp_path, "mirrored", "c" * 40)  # started long before the run: not rewritten by it
    with pytest.raises(SystemExit, match="1 target\\(s\\) failed: bench-pipeline"):
        bench_all.main(["--results", str(tmp_path)])
    assert calls == ["bench-mirrored", "bench-pipeline"]
    data = json.loads((tmp_path / "bench_all.json").read_text())
    assert [(r["target"], r["exit"]) for r in data["targets"]] == [("bench-mirrored", 0), ("bench-pipeline", 2)]
    assert "not rewritten by this run" in data["files"][0]["flags"]
    assert "**FAILED (2)**" in (tmp_path / "bench_all.md").read_text()


def test_results_committed_after_the_run_stay_current_until_measured_code_changes(tmp_path: Path, monkeypatch):
    changed: dict[str, list[str]] = {"d" * 40: [], "e" * 40: ["ds_lightning/strategies/mirrored.py"]}
    monkeypatch.setattr(bench_all, "package_state", lambda: {"commit": "f" * 40, "uncommitted": []})
    monkeypatch.setattr(bench_all, "changed_since", lambda commit, paths: changed.get(commit))
    _result(tmp_path, "mirrored", "d" * 40)
    _result(tmp_path, "pipeline", "d" * 40, repeats=5)
    data = bench_all.build(["bench-mirrored", "bench-pipeline"], [], tmp_path)
    assert data["commits"]["code_unchanged"] == "yes" and all(f["flags"] == [] for f in data["files"])
    assert "All 2 results files were measured at dddddddddd, none flagged" in "\n".join(bench_all.markdown(data))
    _result(tmp_path, "mirrored", "e" * 40)  # control: the same files, one measured before a change to the package
    data = bench_all.build(["bench-mirrored", "bench-pipeline"], [], tmp_path)
    assert data["commits"]["code_unchanged"] == "no"
    flags = {f["file"]: f["flags"] for f in data["files"]}
    assert "measured code changed since: 1 file(s) (ds_lightning/strategies/mirrored.py)" in flags["mirrored.json"]
    assert "NOT ONE RUN AT ONE COMMIT" in "\n".join(bench_all.markdown(data))


def test_a_change_to_one_benchmark_leaves_the_others_results_current(tmp_path: Path, monkeypatch):
    def changed(commit: str, paths: Any) -> list[str]:  # only the faults driver changed since the run
        return ["benchmarks/faults/driver.py"] if "benchmarks/faults" in paths else []

    monkeypatch.setattr(bench_all, "package_state", lambda: {"commit": "f" * 40, "uncommitted": []})
    monkeypatch.setattr(bench_all, "changed_since", changed)
    _result(tmp_path, "pipeline", "d" * 40, repeats=5)
    _result(tmp_path, "faults", "d" * 40)
    data = bench_all.build(["bench-pipeline", "bench-faults"], [], tmp_path)
    flags = {f["file"]: f["flags"] for f in data["files"]}
    assert flags["pipeline.json"] == []
    assert flags["faults.json"] == ["measured code changed since: 1 file(s) (benchmarks/faults/driver.py)"]
    assert data["commits"]["code_unchanged"] == "no"
    assert bench_all.measured_paths("pipeline")[:3] == ("ds_lightning", "benchmarks/harness", "benchmarks/pipeline")
    assert "benchmarks" in bench_all.measured_paths("no such benchmark")  # unknown: any benchmark code counts
    # code a benchmark imports from another folder is measured code too
    assert "benchmarks/sharding_engines" in bench_all.measured_paths("memory")
    cluster = bench_all.measured_paths("cluster")
    assert {"benchmarks/load_balance", "benchmarks/mirrored"} <= set(cluster)
    assert "benchmarks/pipeline" not in cluster


def test_changed_since_reads_git():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bench_all.REPO, capture_output=True, text=True).stdout
    assert bench_all.changed_since(head.strip()) == []
    assert bench_all.changed_since("0" * 40) is None


#: issue 25: the committed results stay compact (per-step spans summarised, palette PNGs)
RESULTS_BYTES_LIMIT = 1_500_000


def test_the_committed_results_stay_under_one_and_a_half_megabytes():
    files = [p for p in harness.RESULTS.iterdir() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    largest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:5]
    assert files and total < RESULTS_BYTES_LIMIT, (
        f"benchmarks/results holds {total} bytes, over {RESULTS_BYTES_LIMIT}; the largest: "
        + ", ".join(f"{p.name} ({p.stat().st_size})" for p in largest)
    )


def test_charts_are_saved_as_palette_pngs():
    from PIL import Image

    rgba = [p.name for p in harness.RESULTS.glob("*.png") if Image.open(p).mode != "P"]
    assert rgba == [], f"saved without harness.figures.save_figure (not a palette PNG): {rgba}"
