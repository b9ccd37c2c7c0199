"""One check that the optimizer-state sharding tests (zero and fsdp2) share: a run that composes gradient accumulation,
LRScaling, a per-step StepLR and BackupAndRestore matches plain ds_mirrored, and resumes exactly from its backup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.callbacks.test_backup_and_restore import N, assert_same_params, final_params, samples_per_epoch, train
from tests.helpers.backup_runs import DIED


def assert_composed_run_matches_plain_and_resumes(
    tmp_path: Path, sharded_kwargs: dict[str, Any], plain_kwargs: dict[str, Any]
) -> dict[int, Any]:
    """Adam with a StepLR per step; global batch 32 = 2 ranks x 8 x 2 accumulated; 12 steps over 4 epochs; a backup
    every 2 steps. The sharded run matches plain (1e-5); killed at step 5, it resumes from a backup to the
    uninterrupted run's parameters (1e-6) with every sample once per epoch. Returns the last backup's optimizer state
    (which holds whole tensors in the plain layout: 8 tensors' Adam state, each at the backup's step; checked)."""
    spec = {"devices": 2, "global_batch": 32, "lr_scaling": True, "max_epochs": 4, "backup": {"every_n_train_steps": 2}}
    sharded = {**spec, "strategy_kwargs": sharded_kwargs}
    plain = train(tmp_path, "plain", {**spec, "strategy_kwargs": plain_kwargs} if plain_kwargs else spec)
    straight = train(tmp_path, "straight", sharded)
    assert plain["global_step"] == straight["global_step"] == 12
    assert_same_params(final_params(tmp_path, "plain"), final_params(tmp_path, "straight"), atol=1e-5)

    train(tmp_path, "cut", {**sharded, "die_at_step": 5}, expect=DIED)
    resumed = train(tmp_path, "cut", {**sharded, "attempt": 1})
    # Backups are written in the background: the one at step 4 may still be in flight when every rank dies.
    restored = Path(resumed["restored_from"])
    assert restored.name in ("backup-step000000002.ckpt", "backup-step000000004.ckpt"), restored
    assert resumed["global_step"] == 12
    assert_same_params(final_params(tmp_path, "straight"), final_params(tmp_path, "cut"), atol=1e-6)
    assert samples_per_epoch(tmp_path, "cut") == {epoch: list(range(N)) for epoch in range(4)}
    latest = sorted((tmp_path / "cut_backups").glob("backup-step*.ckpt"))[-1]
    state = torch.load(latest, weights_only=True)["optimizer_states"][0]["state"]
    assert len(state) == 8 and {float(s["step"]) for s in state.values()} == {float(latest.stem[-9:])}
    return state
