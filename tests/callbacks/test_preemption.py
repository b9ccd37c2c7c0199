"""Preemption: SIGTERM or SIGUSR1 at a random moment, to any one rank, makes every rank back up at one agreed step
and exit with the configured code; the run restarted from those backups ends exactly as the uninterrupted run.

Then the awkward moments: a signal during start-up, while a backup is restored, while one is written; the grace timer
that ends a run whose backup does not come in time; timed backups (``every_n_seconds``). Each case checks every rank's
exit code, that no run hangs, that every backup left loads, and that the next run resumes to the uninterrupted run's
parameters (1e-6) with every sample once per epoch. The moments are made by the test (tests/helpers/backup_runs.py
``events``): the process signals itself from a hook, and a slow write or step is a sleep in that hook, never in the
product. Every run trains with dropout and Python and NumPy draws, so a random state lost on the way shows.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_lightning.backup import BackupStore
from tests.callbacks.test_backup_and_restore import (
    RANDOM_MODEL,
    N,
    assert_same_params,
    final_params,
    samples_per_epoch,
    train,
)
from tests.helpers.backup_runs import DIED
from tests.helpers.runner import WarmRanks

pytestmark = pytest.mark.multiprocess

SIGNALS = 20
EXIT_CODE = 42
EPOCHS = 24  # 144 steps: an interruption takes 3 to 6 (one to start, up to 3 slept, 2 to agree and back up)
SPEC: dict[str, Any] = {
    "devices": 2,
    "max_epochs": EPOCHS,
    "step_sleep": 0.05,
    "model": RANDOM_MODEL,
    "backup": {"every_n_train_steps": None, "exit_code": EXIT_CODE, "grace_seconds": 60},
}


def _batches_logged(out: Path, attempt: int) -> int:
    log = Path(f"{out}.ids.rank0.jsonl")
    if not log.exists():
        return 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    marks = [i for i, entry in enumerate(lines) if entry.get("attempt") == attempt]
    return len(lines) - marks[-1] - 1 if marks else 0


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmRanks]:
    """Two ranks importing Lightning once for this file's 27 runs: each run is still 2 fresh processes, forked."""
    with WarmRanks(2) as ranks:
        yield ranks


def _interrupt(tmp_path: Path, attempt: int, rng: random.Random, ranks: WarmRanks) -> tuple[list[int], str]:
    """Start attempt ``attempt``, signal one rank at a random moment once it trains; return every rank's exit code."""
    out = tmp_path / "cut"
    spec = {"out": str(out), "n": N, "batch_size": 8, "backup_dir": str(tmp_path / "backups"), **SPEC}
    path = tmp_path / f"attempt{attempt}.json"
    path.write_text(json.dumps({**spec, "attempt": attempt}))
    ranks.launch("tests.helpers.backup_runs", [str(path)])
    try:
        deadline = time.monotonic() + 120
        while _batches_logged(out, attempt) < 1:
            assert ranks.poll(), ranks.wait(30).output[-4000:]
            assert time.monotonic() < deadline, "the attempt never started training"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.15))
        rank = rng.randrange(2)  # Kubernetes signals one container's PID 1; SLURM may reach any rank first
        sig = rng.choice([signal.SIGTERM, signal.SIGUSR1])
        os.kill(int(Path(f"{out}.pid.rank{rank}").read_text()), sig)
    except BaseException:
        ranks.kill()
        raise
    run = ranks.wait(240)
    return run.returncodes, run.output


@pytest.mark.timeout(1200)  # 22 runs of 2 processes
def test_signals_at_twenty_random_moments_each_leave_a_backup_and_the_run_ends_exact(
    tmp_path: Path, warm: WarmRanks
) -> None:
    train(tmp_path, "ref", SPEC, warm=warm)
    rng = random.Random(14)
    store = BackupStore(tmp_path / "backups", keep=2)
    steps = []
    for attempt in range(SIGNALS):
        codes, output = _interrupt(tmp_path, attempt, rng, warm)
        assert codes == [EXIT_CODE] * 2, f"attempt {attempt} exited with {codes}:\n{output[-4000:]}"
        latest = store.latest()
        assert latest is not None
        steps.append(torch.load(latest, weights_only=False)["global_step"])
        assert len(steps) == 1 or steps[-1] > steps[-2], f"attempt {attempt} backed up no new step: {steps}"
    total = EPOCHS * N // 16
    assert steps[-1] < total, "the interruptions reached the end of training; lengthen the run"
    resumed = train(tmp_path, "cut", {**SPEC, "backup_dir": str(tmp_path / "backups"), "attempt": SIGNALS}, warm=warm)
    assert resumed["restored_from"] == str(store.latest())
    assert resumed["global_step"] == total
    assert_same_params(final_params(tmp_path, "ref"), final_params(tmp_path, "cut"), atol=1e-6)
    assert samples_per_epoch(tmp_path, "cut") == {epoch: list(range(N)) for epoch in range(EPOCHS)}


def test_preempted_at_an_epochs_end_by_a_run_that_resumed_mid_epoch_the_next_run_starts_the_next_epoch(
    tmp_path: Path, warm: WarmRanks
) -> None:
    """The chain the 20-signal test once failed on: restored at epoch 0's end, backed up mid-epoch 1, restored there,
    preempted on epoch 1's last batch. The position is counted by the callback, not read from Lightning's counters
    (those of a run restored after an epoch-end restore started at 0): before, epoch 1 was trained again from there."""
    spec = {
        "devices": 2,
        "max_epochs": 3,
        "model": RANDOM_MODEL,
        "backup": {"every_n_train_steps": None, "exit_code": EXIT_CODE},
    }
    train(tmp_path, "ref", spec, warm=warm)
    # Each SIGTERM lands as step n + 1 starts; the ranks agree on it at that step's end and back up a step later:
    # backups at 6, 10 and 12.
    for attempt, step in enumerate((4, 8, 10)):
        train(tmp_path, "cut", {**spec, "signal_at_step": step, "attempt": attempt}, expect=EXIT_CODE, warm=warm)
    resumed = train(tmp_path, "cut", {**spec, "attempt": 3}, warm=warm)
    assert resumed["restored_from"].endswith("backup-step000000012.ckpt")
    assert resumed["global_step"] == 18
    assert samples_per_epoch(tmp_path, "cut") == {epoch: list(range(N)) for epoch in range(3)}
    assert_same_params(final_params(tmp_path, "ref"), final_params(tmp_path, "cut"), atol=1e-6)


# --- signals at awkward moments, the grace timer, timed backups ---------------------------------------------------

TIMING_EPOCHS = 3  # 18 steps of 16 samples
TIMING: dict[str, Any] = {
    "devices": 2,
    "max_epochs": TIMING_EPOCHS,
    "model": RANDOM_MODEL,
    # Synchronous unless a case says otherwise: a crash right after a backup in the background may lose it.
    "backup": {"every_n_train_steps": 4, "exit_code": EXIT_CODE, "grace_seconds": 60, "async_save": False},
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, warm: WarmRanks) -> tuple[Path, str]:
    """:data:`TIMING` uninterrupted (backup options and events change no parameter, so every case compares to it)."""
    tmp = tmp_path_factory.mktemp("reference")
    train(tmp, "ref", TIMING, warm=warm)
    return tmp, "ref"


def spec_with(backup: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {**TIMING, "backup": {**TIMING["backup"], **(backup or {})}, **extra}


def preempted(tmp_path: Path, warm: WarmRanks, spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec`` and check that every rank exited with the preemption code, in far less than a hang's time."""
    return train(tmp_path, "cut", spec, expect=EXIT_CODE, timeout=120, warm=warm)  # asserts every rank's code


def backup_steps(tmp_path: Path) -> list[int]:
    """The steps of the backups in the run's directory, each checked to load."""
    store = BackupStore(tmp_path / "cut_backups", keep=100)
    for _, path in store.backups():
        torch.load(path, weights_only=True)  # a complete file, also the newest
    return [step for step, _ in store.backups()]


def temporaries(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "cut_backups").glob(".backup-step*"))


def assert_resumes_exactly(
    tmp_path: Path, reference: tuple[Path, str], warm: WarmRanks, from_step: int, attempt: int, **spec: Any
) -> None:
    """The next run restores the backup of ``from_step`` and ends as the uninterrupted run."""
    resumed = train(tmp_path, "cut", {**spec_with(**spec), "attempt": attempt}, warm=warm)
    assert resumed["restored_from"].endswith(f"backup-step{from_step:09d}.ckpt"), resumed["restored_from"]
    assert resumed["global_step"] == TIMING_EPOCHS * N // 16
    assert not temporaries(tmp_path), "a stale temporary outlived the restart"
    assert_same_params(final_params(*reference), final_params(tmp_path, "cut"), atol=1e-6)
    assert samples_per_epoch(tmp_path, "cut") == {epoch: list(range(N)) for epoch in range(TIMING_EPOCHS)}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_signal_during_start_up_backs_up_after_the_second_step(
    tmp_path: Path, reference: tuple[Path, str], warm: WarmRanks, rank: int
) -> None:
    """SIGUSR1 to one rank in the model's setup hook (process group up, nothing trained): the ranks agree on it at
    step 1's end and back up at step 2. (Before, the signal found no handler and killed that rank.)"""
    preempted(tmp_path, warm, spec_with(events=[{"at": "setup", "ranks": [rank], "signal": "SIGUSR1"}]))
    assert backup_steps(tmp_path) == [2]
    assert_resumes_exactly(tmp_path, reference, warm, from_step=2, attempt=1)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_signal_while_a_backup_is_restored_backs_up_after_two_more_steps(
    tmp_path: Path, reference: tuple[Path, str], warm: WarmRanks, rank: int
) -> None:
    """Killed at step 7 (backup at 4); the restart gets SIGTERM on one rank while the model restores the backup (and
    the restore then takes a second): every rank backs up at step 6 and exits; the next run ends exact."""
    train(tmp_path, "cut", spec_with(die_at_step=7), expect=DIED, warm=warm)
    event = {"at": "restore", "ranks": [rank], "signal": "SIGTERM", "sleep": 1.0}
    preempted(tmp_path, warm, spec_with(events=[event], attempt=1))
    assert backup_steps(tmp_path) == [4, 6]
    assert_resumes_exactly(tmp_path, reference, warm, from_step=6, attempt=2)


@pytest.mark.parametrize(("async_save", "backed_up"), [(True, ([4, 5], [4, 6])), (False, ([4, 5],))])
def test_a_signal_while_a_backup_is_written_backs_up_after_it(
    tmp_path: Path, reference: tuple[Path, str], warm: WarmRanks, async_save: bool, backed_up: tuple[list[int], ...]
) -> None:
    """SIGTERM to the writing rank in the middle of writing the backup of step 4, which then takes 2 s more.
    Synchronous, the flag is agreed from step 4's end: backup at 5. In the background the loop trains on, and the
    flag is agreed from step 4's or 5's end (the writer thread races the loop to the signal): the next backup waits
    for the slow one. Both load, and the next run ends exact."""
    event = {"at": "write", "step": 4, "ranks": [0], "signal": "SIGTERM", "sleep": 2.0}
    preempted(tmp_path, warm, spec_with({"async_save": async_save}, events=[event]))
    steps = backup_steps(tmp_path)
    assert steps in backed_up
    assert not temporaries(tmp_path)
    assert_resumes_exactly(tmp_path, reference, warm, from_step=steps[-1], attempt=1)


def test_the_grace_timer_ends_a_step_too_long_to_wait_for_and_the_previous_backup_stands(
    tmp_path: Path, reference: tuple[Path, str], warm: WarmRanks
) -> None:
    """Every rank gets SIGTERM as step 5 starts, and step 5 would take a minute: after grace_seconds=2 every rank
    exits with the code, long before the step ends; the backup of step 4 stands and the next run ends exact."""
    events = [{"at": "step", "step": 5, "ranks": [0, 1], "signal": "SIGTERM", "sleep": 60.0}]
    run = preempted(tmp_path, warm, spec_with({"grace_seconds": 2}, events=events))
    assert "no backup within grace_seconds=2" in run["output"]
    assert backup_steps(tmp_path) == [4]
    assert_resumes_exactly(tmp_path, reference, warm, from_step=4, attempt=1)


def test_the_grace_timer_ends_a_write_too_long_to_wait_for_and_the_previous_backup_stands(
    tmp_path: Path, reference: tuple[Path, str], warm: WarmRanks
) -> None:
    """SIGTERM to the writer in the middle of the synchronous backup of step 8, which would take a minute, and to
    the other rank as it trains on (it waits for the writer in that step's all-reduce): after grace_seconds=2 both
    exit with the code (the other one when the writer's exit fails its collective, if its own timer has not fired).
    The half-written backup is only a temporary; the restart removes it and resumes exactly from step 4."""
    events = [
        {"at": "write", "step": 8, "ranks": [0], "signal": "SIGTERM", "sleep": 60.0},
        {"at": "step", "step": 8, "ranks": [1], "signal": "SIGTERM"},
    ]
    run = preempted(tmp_path, warm, spec_with({"grace_seconds": 2}, events=events))
    assert "no backup within grace_seconds=2" in run["output"]
    assert backup_steps(tmp_path) == [4]
    assert len(temporaries(tmp_path)) == 1
    assert_resumes_exactly(tmp_path, reference, warm, from_step=4, attempt=1)


def test_timed_backups_keep_their_interval_and_a_run_killed_after_them_resumes_exactly(
    tmp_path: Path, reference: tuple[Path, str], warm: WarmRanks
) -> None:
    """Backups by time only (every 0.6 s, steps of at least 0.1 s slept): consecutive backups are more than 0.6 s of
    training apart and at most 7 steps; killed at step 17, the run resumes from the newest exactly."""
    interval, sleep = 0.6, 0.1
    backup = {"every_n_train_steps": None, "every_n_seconds": interval, "keep": 100}
    train(tmp_path, "cut", spec_with(backup, step_sleep=sleep, die_at_step=17), expect=DIED, warm=warm)
    steps = backup_steps(tmp_path)
    assert len(steps) >= 2, steps
    # The backup of step n is taken at the end of the batch logged as step n - 1; when those batches started, on
    # rank 0 (whose clock decides).
    started = {}
    for line in (tmp_path / "cut.ids.rank0.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "step" in entry:
            started[entry["step"]] = entry["t"]
    for before, after in itertools.pairwise(steps):
        assert started[after - 1] - started[before - 1] > interval, (steps, started)
        # The timer is read at each step's end: at most ceil(0.6 / 0.1) = 6 steps pass it, 1 more agrees on it.
        assert after - before <= math.ceil(interval / sleep) + 1, steps
    assert_resumes_exactly(tmp_path, reference, warm, from_step=steps[-1], attempt=1, backup=backup)
