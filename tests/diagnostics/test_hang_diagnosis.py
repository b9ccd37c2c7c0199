"""A stuck collective is named within timeout + 10 s: real two-rank ``ds_mirrored`` runs on gloo, each hanging on
purpose (tests/helpers/hang_runs.py), with a 10 s timeout.

Every rank's exit code is checked: every faulty run fails on both ranks, and the control (no fault) ends on both with
no verdict and no dump written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_lightning.diagnostics.analyze import diagnose_folder
from tests.helpers.runner import Run, run_ranks, worker_env

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 10.0
STEP = 3


def hang(tmp_path: Path, fault: str, rank: int = 1) -> tuple[Run, dict]:
    run = run_ranks("tests.helpers.hang_runs", [fault, str(rank), str(STEP), str(tmp_path), str(TIMEOUT_S)], 2, 150)
    verdict = tmp_path / "flight_recorder" / "verdict_rank0.json"
    assert verdict.exists(), run.output[-6000:]
    found = json.loads(verdict.read_text())
    assert run.returncodes[0] != 0 and run.returncodes[1] != 0, run.returncodes
    # Rank 0's error carries the verdict, and came within timeout + 10 s of the call it waited in.
    assert "ds_lightning hang diagnosis" in run.output and found["message"].splitlines()[0] in run.output
    assert found["after_s"] <= TIMEOUT_S + 10, found
    dumps = sorted(p.name for p in (tmp_path / "flight_recorder").glob("fr_rank_*"))
    assert dumps == ["fr_rank_0", "fr_rank_1"], dumps  # every rank still running dumped its Flight Recorder
    return run, found


def analyzed(tmp_path: Path) -> str:
    """What torch's analyzer finds in the dumps afterwards (``ds-train diagnose``), the run's verdicts left out."""
    lines = diagnose_folder(tmp_path / "flight_recorder")
    return "\n".join(lines[: next(i for i, line in enumerate(lines) if line.startswith("The run's own verdict"))])


def test_a_rank_sleeping_in_training_step_is_named_as_not_arrived_with_where_it_is(tmp_path: Path) -> None:
    _, verdict = hang(tmp_path, "sleep")
    assert verdict["kind"] == "missing"
    assert (verdict["stuck"]["op"], verdict["stuck"]["sizes"]) == ("all_reduce", [[1210]])  # DDP's gradient bucket
    assert verdict["stuck"]["place"].startswith("backward")
    assert verdict["arrived"] == [0] and list(verdict["missing"]) == ["1"]
    assert verdict["missing"]["1"].startswith("training_step (helpers/hang_runs.py:")
    seq = verdict["stuck"]["seq"]
    assert f"all_reduce #{seq} on process group '0:default_pg' (sizes [[1210]]): ranks [1] never joined it" in analyzed(
        tmp_path
    )
    # The command itself, as a user types it.
    done = subprocess.run(
        [sys.executable, "-m", "ds_lightning.cli", "diagnose", str(tmp_path / "flight_recorder")],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(),
    )
    assert done.returncode == 0 and "ranks [1] never joined it" in done.stdout, done.stdout + done.stderr


def test_a_rank_that_skipped_a_collective_is_found_waiting_in_a_later_one(tmp_path: Path) -> None:
    """Rank 1 skips the all-reduce and goes on to the next step, whose first collective is Lightning's own."""
    _, verdict = hang(tmp_path, "skip")
    assert verdict["kind"] == "desync"
    assert (verdict["stuck"]["op"], verdict["stuck"]["place"].split()[0]) == ("all_reduce", "on_train_batch_end")
    other = verdict["desync"]["1"]
    assert (other["op"], other["seq"]) == ("broadcast", verdict["stuck"]["seq"])
    assert other["place"].startswith("Lightning's SIGTERM broadcast before a step"), other
    assert "skipped or added a collective" in verdict["message"]
    assert f"desync, rank 1 called broadcast #{verdict['stuck']['seq']}" in analyzed(tmp_path)


def test_two_ranks_in_different_collectives_are_named_as_a_desync(tmp_path: Path) -> None:
    _, verdict = hang(tmp_path, "desync")
    assert verdict["kind"] == "desync" and verdict["arrived"] == [0]
    assert (verdict["stuck"]["op"], verdict["desync"]["1"]["op"]) == ("all_reduce", "broadcast")
    assert verdict["desync"]["1"]["place"].split()[0] == "on_train_batch_end"
    assert "collective type mismatch" in analyzed(tmp_path)


def test_control_a_run_without_a_fault_writes_no_verdict(tmp_path: Path) -> None:
    run = run_ranks("tests.helpers.hang_runs", ["none", "1", str(STEP), str(tmp_path), str(TIMEOUT_S)], 2, 150)
    run.assert_every_rank_exits(0)
    assert not (tmp_path / "flight_recorder").exists()
    assert "hang diagnosis" not in run.output


def test_diagnose_says_what_it_needs_when_a_folder_holds_no_dump(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ds_lightning.cli", "diagnose", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "holds no Flight Recorder dump (fr_rank_<rank> files)" in done.stdout
