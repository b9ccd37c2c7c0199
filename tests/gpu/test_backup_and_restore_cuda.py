"""BackupAndRestore under ds_mirrored on CUDA: killed mid-epoch and restarted, the run ends where the uninterrupted one
does, every sample once per epoch. Control: the same resume with the backup's CUDA random states replaced (the
dropout masks are drawn on the GPU) ends elsewhere. Runs, spec and checks are the CPU tests'
(tests/callbacks/test_backup_and_restore.py), with ``accelerator="cuda"``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ds_lightning.backup import BackupStore
from ds_lightning.callbacks.backup_and_restore import CHECKPOINT_KEY
from tests.callbacks.test_backup_and_restore import (
    RANDOM_SPEC,
    N,
    assert_same_params,
    final_params,
    max_difference,
    samples_per_epoch,
    train,
)
from tests.gpu._cuda import gpus
from tests.helpers.backup_runs import DIED

pytestmark = pytest.mark.cuda


def _scramble_cuda_random_states(backup_dir: Path) -> None:
    """Test side, as if the restore of the CUDA generators were dropped: the newest backup's become another seed's."""
    path = BackupStore(backup_dir, keep=1).latest()
    assert path is not None
    checkpoint = torch.load(path, weights_only=False)
    other = torch.Generator(device="cuda").manual_seed(12345).get_state()
    for states in checkpoint[CHECKPOINT_KEY]["random_states"]:
        assert "cuda" in states, sorted(states)  # the training process had initialised CUDA
        states["cuda"] = [other.clone() for _ in states["cuda"]]
    torch.save(checkpoint, path)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_mirrored_on_cuda_resumes_exactly_and_needs_the_cuda_random_states(tmp_path):
    world = gpus()
    # Dropout (on the GPU), Python's and NumPy's draws every step; the global batch of 16 on 1 or 2 GPUs.
    spec = {**RANDOM_SPEC, "accelerator": "cuda", "devices": world, "backup": {"every_n_train_steps": 2}}
    reference, cut, control = tmp_path / "reference", tmp_path / "cut", tmp_path / "control"
    reference.mkdir()
    cut.mkdir()
    train(reference, "ref", spec)
    train(cut, "cut", {**spec, "die_at_step": 9}, expect=DIED)
    shutil.copytree(cut, control)
    _scramble_cuda_random_states(control / "cut_backups")

    resumed = train(cut, "cut", {**spec, "attempt": 1})
    assert resumed["restored_from"] is not None and "backup-step000000008" in resumed["restored_from"]
    assert resumed["global_step"] == 12  # 96 samples / 16 per step x 2 epochs: no step added or lost
    epochs = samples_per_epoch(cut, "cut")
    assert epochs == {0: list(range(N)), 1: list(range(N))}
    assert epochs == samples_per_epoch(reference, "ref")
    assert_same_params(final_params(reference, "ref"), final_params(cut, "cut"), atol=1e-5)

    train(control, "cut", {**spec, "attempt": 1})
    difference = max_difference(final_params(reference, "ref"), final_params(control, "cut"))
    assert difference > 1e-3, f"the CUDA random states made no difference ({difference})"
