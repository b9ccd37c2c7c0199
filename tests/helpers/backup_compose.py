"""One check that the optimizer-state sharding tests (zero and fsdp2) share: a run that composes gradient accumulation,
LRScaling, a per-step StepLR and BackupAndRestore matches plain ds_mirrored, and resumes exactly from its backup.

It also shows the features were on: each rank of the sharded run holds about half the optimizer state plain holds,
and under PowerSGD every rank's error feedback is in the checkpoint and non-zero, while the same run with PowerSGD
off (the control) ends elsewhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.callbacks.test_backup_and_restore import N, assert_same_params, final_params, samples_per_epoch, train
from tests.helpers.backup_runs import DIED
from tests.helpers.runner import WarmRanks


def assert_composed_run_matches_plain_and_resumes(
    tmp_path: Path, sharded_kwargs: dict[str, Any], plain_kwargs: dict[str, Any]
) -> dict[int, Any]:
    """Adam with a StepLR per step; global batch 32 = 2 ranks x 8 x 2 accumulated; 12 steps over 4 epochs; a backup
    every 2 steps. The sharded run matches plain (1e-5); killed at step 5, it resumes from a backup to the
    uninterrupted run's parameters (1e-6) with every sample once per epoch. Returns the last backup's optimizer state
    (which holds whole tensors in the plain layout: 8 tensors' Adam state, each at the backup's step; checked)."""
    with WarmRanks(2) as warm:  # every run forks from 2 ranks that imported Lightning once
        spec = {
            "devices": 2,
            "global_batch": 32,
            "lr_scaling": True,
            "max_epochs": 4,
            "backup": {"every_n_train_steps": 2},
            "record_optimizer_state": True,  # each rank's own optimizer-state bytes, for _assert_sharded
        }
        sharded = {**spec, "strategy_kwargs": sharded_kwargs}
        plain = train(tmp_path, "plain", {**spec, "strategy_kwargs": plain_kwargs} if plain_kwargs else spec, warm=warm)
        straight = train(tmp_path, "straight", sharded, warm=warm)
        assert plain["global_step"] == straight["global_step"] == 12
        assert_same_params(final_params(tmp_path, "plain"), final_params(tmp_path, "straight"), atol=1e-5)
        _assert_sharded(tmp_path, "plain", "straight")
        if sharded_kwargs.get("gradient_compression", "none") != "none":
            _assert_compressed(tmp_path, "straight", sharded, 1e-5, warm)

        train(tmp_path, "cut", {**sharded, "die_at_step": 5}, expect=DIED, warm=warm)
        resumed = train(tmp_path, "cut", {**sharded, "attempt": 1}, warm=warm)
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


def _state_bytes(tmp_path: Path, name: str) -> list[int]:
    return [json.loads((tmp_path / f"{name}.optimizer.rank{r}.json").read_text())["state_bytes"] for r in (0, 1)]


def _assert_sharded(tmp_path: Path, plain: str, sharded: str) -> None:
    """Each rank of the sharded run holds about half of the whole optimizer state (ZeRO splits whole tensors, fsdp2
    every tensor); an unsharded run holds all of it on every rank."""
    whole = _state_bytes(tmp_path, plain)
    assert whole[0] == whole[1] > 0, whole
    shards = _state_bytes(tmp_path, sharded)
    print(f"optimizer-state bytes per rank: plain {whole}, sharded {shards}")
    assert all(0.4 * whole[0] <= shard <= 0.6 * whole[0] for shard in shards), (shards, whole)


def _assert_compressed(tmp_path: Path, name: str, sharded: dict[str, Any], atol: float, warm: WarmRanks) -> None:
    """PowerSGD's error feedback exists and is non-zero on every rank, and PowerSGD off changes the result."""
    saved = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)["ds_mirrored"]
    assert saved["gradient_compression"] == "powersgd" and len(saved["compression_states"]) == 2
    for state in saved["compression_states"]:
        assert state["iter"] > 0 and state["error"], state.keys()
        assert max(e.abs().max().item() for e in state["error"].values()) > 0
    kwargs = {k: v for k, v in sharded["strategy_kwargs"].items() if not k.startswith(("gradient_comp", "powersgd"))}
    train(tmp_path, "uncompressed", {**sharded, "strategy_kwargs": kwargs, "record_optimizer_state": False}, warm=warm)
    off, on = final_params(tmp_path, "uncompressed"), final_params(tmp_path, name)
    difference = max((off[key] - on[key]).abs().max().item() for key in on)
    print(f"largest parameter difference, PowerSGD off against on: {difference:.3g}")
    assert difference > 10 * atol, difference  # PowerSGD shaped the run far beyond the parity tolerance
