"""Preemption: SIGTERM or SIGUSR1 at a random moment, to any one rank, makes every rank back up at one agreed step
and exit with the configured code; the run restarted from those backups ends exactly as the uninterrupted run.
"""

from __future__ import annotations

import json
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
    N,
    assert_same_params,
    final_params,
    samples_per_epoch,
    train,
)
from tests.helpers.runner import WarmRanks

pytestmark = pytest.mark.multiprocess

SIGNALS = 20
EXIT_CODE = 42
EPOCHS = 24  # 144 steps: an interruption takes 3 to 6 (one to start, up to 3 slept, 2 to agree and back up)
SPEC: dict[str, Any] = {
    "devices": 2,
    "max_epochs": EPOCHS,
    "step_sleep": 0.05,
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
    spec = {"devices": 2, "max_epochs": 3, "backup": {"every_n_train_steps": None, "exit_code": EXIT_CODE}}
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
