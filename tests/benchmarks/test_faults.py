"""The fault benchmark's reading of a killed run and its summary, on synthetic stamps and records (nothing runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness
from benchmarks.faults.driver import STRATEGIES, Faults, overhead_arm, recovery_reading
from benchmarks.harness.cli import parser, resolve


def _stamps() -> list[dict[str, Any]]:
    first = [
        {"event": "process_start", "t": 10.0, "pid": 1, "step": 0, "t_process": 2.0, "t_imported": 5.0},
        {"event": "setup", "t": 10.0, "pid": 1, "step": 0},
        {"event": "train_start", "t": 10.1, "pid": 1, "step": 0},
        *({"event": "step", "t": 10.1 + 0.1 * i, "pid": 1, "step": i} for i in range(1, 48)),
        {"event": "kill", "t": 15.0, "pid": 1, "step": 47},
    ]
    again = [
        {"event": "process_start", "t": 25.0, "pid": 2, "step": 0, "t_process": 15.5, "t_imported": 19.0},
        {"event": "setup", "t": 25.0, "pid": 2, "step": 0},
        {"event": "train_start", "t": 25.5, "pid": 2, "step": 40},
        {"event": "step", "t": 26.0, "pid": 2, "step": 41},
        {"event": "step", "t": 26.1, "pid": 2, "step": 42},
    ]
    return first + again


def test_recovery_reading_splits_kill_to_first_new_step():
    r = recovery_reading(_stamps(), every=20)
    assert r["recovery_s"] == pytest.approx(11.0)  # kill at 15.0, first new step ends at 26.0
    parts = ("relaunch_s", "imports_s", "startup_s", "restore_s", "first_step_s")
    assert [r[k] for k in parts] == pytest.approx([0.5, 3.5, 6.0, 0.5, 0.5])
    assert sum(r[k] for k in parts) == pytest.approx(r["recovery_s"])
    assert (r["kill_step"], r["resumed_step"], r["steps_lost"], r["since_backup"]) == (47, 40, 7, 7)


def test_recovery_reading_after_one_rank_killed_skips_the_survivors_last_events():
    stamps = _stamps()
    kill = next(s for s in stamps if s["event"] == "kill")
    kill.update(pid=3, rank=1)  # rank 1 killed itself; rank 0 (pid 1) ran one more step, then failed
    stamps[stamps.index(kill) + 1 : stamps.index(kill) + 1] = [
        {"event": "step", "t": 15.1, "pid": 1, "step": 48},
        {"event": "failed", "t": 15.3, "pid": 1, "step": 48, "error": "RuntimeError: Connection closed by peer"},
    ]
    r = recovery_reading(stamps, every=20)
    assert r["detect_s"] == pytest.approx(0.3)
    assert r["first_step_s"] == pytest.approx(0.5)  # the re-run's first step, not rank 0's step 48
    # Rank 0 completed step 48 before it failed: that step is done again too.
    assert (r["kill_step"], r["resumed_step"], r["steps_lost"]) == (47, 40, 8)


def test_recovery_reading_names_a_missing_kill_or_rerun():
    stamps = _stamps()
    with pytest.raises(ValueError, match="no kill"):
        recovery_reading([s for s in stamps if s["event"] != "kill"], every=20)
    with pytest.raises(ValueError, match="kill at step 47 never reached a training step"):
        recovery_reading([s for s in stamps if s["pid"] == 1], every=20)


def _records() -> list[dict[str, Any]]:
    out = []
    for rep in range(3):
        base = 100.0 + rep
        for arm, f in [("mlp1m_none", 1.0), ("mlp1m_sync50", 1.10), ("mlp1m_async50", 1.02)]:
            ms = base * f
            out.append(
                {
                    "arm": arm,
                    "repeat": rep,
                    "order": 0,
                    "seconds": 1.0,
                    "params": 1126410,
                    "mean_step_ms": ms,
                    "median_step_ms": ms,
                    "max_step_ms": 2 * ms,
                    "mean_over_median": f,  # as if every step were the usual one times f
                    "save_ms": 5.0,
                    "write_ms": None,
                }
            )
        out.append(
            {
                "arm": "recover_ds_mirrored",
                "repeat": rep,
                "order": 3,
                "seconds": 30.0,
                **recovery_reading(_stamps(), every=20),
            }
        )
    return out


def test_render_reports_the_target_and_recovery(tmp_path: Path):
    params = {
        "mlp1m_none": {"part": "overhead", "model": "mlp1m", "backup": None},
        "mlp1m_sync50": {"part": "overhead", "model": "mlp1m", "backup": {"every": 50, "async": False}},
        "mlp1m_async50": {"part": "overhead", "model": "mlp1m", "backup": {"every": 50, "async": True}},
        "recover_ds_mirrored": {"part": "recovery", "strategy": "ds_mirrored", "kill_rank": None},
    }
    data = {
        "benchmark": "faults",
        "settings": {"repeats": 2, "batch_size": 32, "warmup": 10, "steps": 200, "recovery_every": 20},
        "package": {"commit": "0123456789abcdef", "uncommitted": []},
        "arms": {a: a.removeprefix("recover_") for a in params},
        "arm_params": params,
        "baseline": None,
        "records": _records(),
    }
    harness.write_json(tmp_path / "faults.json", data)
    harness.main(Faults(), ["--render", str(tmp_path / "faults.json")])
    md = (tmp_path / "faults.md").read_text()
    # Per repeat: async = 1.02x none, so one backup adds 0.02 x 50 = 1 step of 100, 101 or 102 ms (repeats 0-2).
    ratio = "1.020"
    # From timings: 1 + 5 ms of wait / (50 steps x 101 ms).
    assert f"| async | 50 | 103.02 [102.00 - 104.04] | {ratio} | {ratio} | 1.001 | 101 [100 - 102] | 5 | - |" in md
    assert "| sync | 50 | 111.10 [110.00 - 112.20] | 1.100 | 1.100 | 1.001 | 505 [500" in md
    assert (
        f"async every 50 steps <= 1.05x), mlp1m: {ratio} -> met** (in-run estimate {ratio}: met; from timings 1.001)."
        in md
    )
    assert "| ds_mirrored | 11.00 | - | 0.50 | 3.50 |" in md
    assert "| 47 | 40 | 7 | 7 |" in md
    assert (tmp_path / "faults.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(json.dumps(Faults().summarise(data)))
    assert summary["target"]["mlp1m"]["met"] is True


def test_overhead_arm_names():
    assert overhead_arm("mlp10m", None) == "mlp10m_none"
    assert overhead_arm("mlp10m", 200, async_save=False) == "mlp10m_sync200"
    assert overhead_arm("mlp1m", 10) == "mlp1m_async10"


def test_full_run_keeps_every_arm_the_docs_and_the_target_read():
    bench = Faults()
    opts = resolve(bench, parser(bench).parse_args(["--out", "unused"]))
    bench.meta(opts)
    arms = {a.name for a in bench.experiment(opts).arms}
    assert {"mlp1m_none", "mlp1m_async50", "mlp10m_none", "mlp10m_async50"} <= arms  # the target, both models
    assert {"mlp1m_sync10", "mlp1m_async10"} <= arms  # sync against async
    assert {f"recover_{s}{k}" for s in STRATEGIES for k in ("", "_netns")} | {"recover_ds_mirrored_rank1"} <= arms
    assert opts.repeats >= harness.MIN_LAUNCHES
