"""Backup files are whole or absent: atomic writes survive a kill mid-write, and only the newest ``keep`` remain."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ds_lightning.backup import BackupStore, BackupWriter
from tests.helpers.runner import REPO, worker_env

# Writes ever larger backups without end, so the parent can kill it while a write is under way.
_ENDLESS_WRITER = """
import sys, torch
from ds_lightning.backup import BackupStore
store = BackupStore(sys.argv[1], keep=2)
store.write({"step": 1, "w": torch.ones(4)}, store.path_for(1))
print("first", flush=True)
step = 2
while True:
    store.write({"step": step, "w": torch.full((12_000_000,), float(step))}, store.path_for(step))
    step += 1
"""


@pytest.mark.multiprocess
def test_a_kill_in_the_middle_of_a_write_leaves_the_previous_backup_loadable(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _ENDLESS_WRITER, str(tmp_path)], cwd=REPO, env=worker_env(), stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"first"
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".backup-step*.tmp-*")):
            assert time.monotonic() < deadline, "the writer never started a second backup"
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert list(tmp_path.glob(".backup-step*.tmp-*")), "the kill did not land during a write"
    store = BackupStore(tmp_path, keep=2)
    latest = store.latest()
    assert latest is not None
    state = torch.load(latest, weights_only=True)
    assert state["w"].eq(float(state["step"])).all()  # a complete file, not a torn one
    store.remove_stale_temporaries()
    assert not list(tmp_path.glob(".backup-step*"))
    assert store.latest() == latest


def test_only_the_newest_keep_backups_remain_and_latest_is_by_step(tmp_path: Path) -> None:
    store = BackupStore(tmp_path / "b", keep=2)
    assert store.latest() is None
    for step in (10, 200, 30):
        store.write({"step": step}, store.path_for(step))
    assert [s for s, _ in store.backups()] == [30, 200]
    assert store.latest() == store.path_for(200)


def test_the_async_writer_copies_the_state_before_training_changes_it(tmp_path: Path) -> None:
    store = BackupStore(tmp_path, keep=3)
    writer = BackupWriter(store, async_save=True)
    weight = torch.zeros(1000)
    for step in (1, 2, 3):
        writer.save_checkpoint({"w": weight}, store.path_for(step))
        weight.add_(1.0)  # the optimizer step that follows a backup
    writer.teardown()
    for step in (1, 2, 3):
        saved = torch.load(store.path_for(step), weights_only=True)["w"]
        torch.testing.assert_close(saved, torch.full((1000,), float(step - 1)))


Pair = collections.namedtuple("Pair", "tensor count")


def test_the_async_writer_copies_nested_tensors_and_keeps_the_rest_as_saved(tmp_path: Path) -> None:
    store = BackupStore(tmp_path, keep=1)
    writer = BackupWriter(store, async_save=True)
    model = torch.nn.Linear(3, 2)
    weight = torch.zeros(4)
    checkpoint = {
        "state_dict": model.state_dict(),
        "nested": [(weight, 1), Pair(weight, 2), {"deep": [weight]}],
        "python_random": random.getstate(),  # 625 ints, kept whole
    }
    writer.save_checkpoint(checkpoint, store.path_for(1))
    weight.add_(1.0)
    with torch.no_grad():
        model.weight.add_(1.0)
    writer.teardown()
    saved = torch.load(store.path_for(1), weights_only=False)
    assert saved["state_dict"]._metadata == model.state_dict()._metadata  # load_state_dict's version information
    torch.testing.assert_close(saved["state_dict"]["weight"], model.weight.detach() - 1.0)
    (first, one), (second, two), deep = saved["nested"]
    assert (one, two, type(saved["nested"][1]).__name__) == (1, 2, "Pair")
    for tensor in (first, second, deep["deep"][0]):
        torch.testing.assert_close(tensor, torch.zeros(4))
    assert saved["python_random"] == checkpoint["python_random"]


class _StuckStore(BackupStore):
    """A store whose writes hang until released, like a hung network file system."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, keep=2)
        self.release = threading.Event()

    def write(self, checkpoint: dict, path: Path) -> None:
        self.release.wait(30)
        super().write(checkpoint, path)


def test_a_hung_write_fails_the_next_save_within_the_timeout_naming_the_directory(tmp_path: Path) -> None:
    store = _StuckStore(tmp_path / "backups")
    writer = BackupWriter(store, async_save=True, timeout=0.3)
    writer.save_checkpoint({"w": torch.zeros(3)}, store.path_for(1))  # returns: the write is the thread's
    # Unbounded, the save would wait out the 30 s hang and then succeed.
    with pytest.raises(TimeoutError, match=r"'.*backups' took more than 0.3 s .*longer timeout"):
        writer.save_checkpoint({"w": torch.ones(3)}, store.path_for(2))
    assert not store.release.is_set()
    store.release.set()
    writer.timeout = None
    writer.teardown()
    assert store.latest() == store.path_for(1)  # the hung write still lands once released; the failed save did not
