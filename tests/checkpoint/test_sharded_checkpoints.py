"""Sharded checkpoints (``state_dict_type="sharded"``): every rank writes its part with DCP, in Lightning FSDP's
layout; resuming from one equals the uninterrupted run, also at another world size and after consolidation into one
file for a plain Trainer; a kill during a sharded backup's write leaves the previous backup the latest.

Runs go through tests/helpers/sharded_ckpt_runs.py (backup_runs with switches; real processes on gloo).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint
from torch.utils.data import DataLoader

import ds_lightning
from ds_lightning.backup import BackupStore
from ds_lightning.callbacks import BackupAndRestore
from ds_lightning.checkpoint import META_FILENAME, ShardedGroup, is_sharded_checkpoint, read_checkpoint, save_sharded
from ds_lightning.checkpoint.layout import SavedShards, holds_optimizer_state, read_part
from tests.helpers.backup_runs import DIED, Net, make_data
from tests.helpers.runner import REPO, Run, WarmRanks, run_module, run_ranks, worker_env

N = 96  # samples per epoch: 6 optimizer steps per epoch at a global batch of 16, 12 in all
SHARDED = {"state_dict_type": "sharded"}
MIRRORED = {"devices": 2, "batch_size": 8, "strategy_kwargs": SHARDED, "backup": {"every_n_train_steps": 4}}


def train(tmp: Path, name: str, spec: dict[str, Any], expect: int = 0, warm: WarmRanks | None = None) -> Run:
    """Run one spec; every rank must exit with ``expect``."""
    out = tmp / name
    spec = {"out": str(out), "n": N, "max_epochs": 2, "backup_dir": str(tmp / f"{name}_backups"), **spec}
    path = tmp / f"{name}-{spec.get('attempt', 0)}-{expect}.json"
    path.write_text(json.dumps(spec))
    ranks = spec.get("devices", 2) if spec.get("strategy", "ds_mirrored") != "ds_parameter_server" else 1
    if warm is not None and warm.size == ranks:
        run = warm.run("tests.helpers.sharded_ckpt_runs", [str(path)], timeout=150)
    elif ranks > 1:
        run = run_ranks("tests.helpers.sharded_ckpt_runs", [str(path)], ranks, timeout=150)
    else:
        run = run_module("tests.helpers.sharded_ckpt_runs", [str(path)], timeout=150)
    run.assert_every_rank_exits(expect)
    return run


def final_params(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    """The model of the run's last checkpoint (a sharded folder), read the way Lightning consolidates one."""
    folder = tmp / f"{name}.ckpt"
    assert is_sharded_checkpoint(folder), f"{folder} is not a sharded checkpoint folder"
    return _load_distributed_checkpoint(folder)["model"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def restored_step(run_dir: Path, name: str) -> int:
    summary = json.loads((run_dir / f"{name}.json").read_text())
    return int(summary["restored_from"].rsplit("step", 1)[1].split(".")[0])


# --- no processes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["shard", "FULL", None, 1])
def test_state_dict_type_is_checked_with_the_fix(value: object) -> None:
    for cls in (ds_lightning.MirroredStrategy, ds_lightning.ParameterServerStrategy):
        with pytest.raises(ValueError, match=r"state_dict_type=.*'sharded'"):
            cls(state_dict_type=value)
    # Control: both spellings are taken, and "full" stays the default.
    assert ds_lightning.MirroredStrategy(state_dict_type="sharded").state_dict_type == "sharded"
    assert ds_lightning.ParameterServerStrategy(state_dict_type="sharded").state_dict_type == "sharded"
    assert ds_lightning.MirroredStrategy().state_dict_type == "full"


def _stepped_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def test_the_folder_is_lightning_fsdps_layout(tmp_path: Path) -> None:
    """One process writes a folder Lightning's consolidation reads; its FQN-keyed optimizer state loads into a plain
    torch optimizer by position. Control: without ``meta.pt`` the folder is not a (complete) checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optimizer = _stepped_model()
    checkpoint = {"state_dict": get_model_state_dict(model), "global_step": 2, "epoch": 0}
    checkpoint["optimizer_states"] = [get_optimizer_state_dict(model, optimizer)]
    folder = tmp_path / "step2.ckpt"
    save_sharded(*_split(checkpoint), folder, ShardedGroup(no_dist=True))
    assert META_FILENAME == _METADATA_FILENAME
    consolidated = _load_distributed_checkpoint(folder)
    assert consolidated["global_step"] == 2 and consolidated.keys() >= {"model", "optimizer_0"}
    fresh_model, _ = _stepped_model()
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=0.5)
    fresh.load_state_dict(consolidated["optimizer_0"])
    for old, new in zip(optimizer.param_groups[0]["params"], fresh.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(optimizer.state[old]["exp_avg_sq"], fresh.state[new]["exp_avg_sq"], rtol=0, atol=0)
    assert fresh.param_groups[0]["lr"] == 0.1
    loaded = read_checkpoint(folder)
    assert loaded["state_dict"] == SavedShards(folder, "model")
    assert loaded["optimizer_states"] == [SavedShards(folder, "optimizer_0")]
    assert list(read_part(loaded["optimizer_states"][0])["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    (folder / META_FILENAME).unlink()
    assert not is_sharded_checkpoint(folder)


def _split(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    from ds_lightning.checkpoint.layout import split_checkpoint

    return split_checkpoint(checkpoint)


def test_the_store_lists_committed_folders_only(tmp_path: Path) -> None:
    """A sharded backup counts once renamed to its name; a temporary folder never does, and is removed when stale."""
    store = BackupStore(tmp_path, keep=2)
    model, _ = _stepped_model()
    state = {"model": model.state_dict()}
    for step in (2, 4, 6):
        folder = store.temporary_folder(store.path_for(step))
        save_sharded(state, {}, folder, ShardedGroup(no_dist=True, coordinator=False))
        assert store.latest() in (None, store.path_for(step - 2))  # not yet committed: the previous one stands
        store.commit_folder({"global_step": step}, folder, store.path_for(step))
        assert store.latest() == store.path_for(step) and is_sharded_checkpoint(store.path_for(step))
    assert [step for step, _ in store.backups()] == [4, 6]  # pruned to keep=2, folders removed
    stale = store.temporary_folder(store.path_for(8))
    save_sharded(state, {}, stale, ShardedGroup(no_dist=True, coordinator=False))
    assert store.latest() == store.path_for(6)
    store.remove_stale_temporaries()
    assert not stale.exists() and store.latest() == store.path_for(6)


# --- ds_mirrored (the base defaults) on 2 processes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> Iterator[WarmRanks]:
    with WarmRanks(2) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, pair: WarmRanks) -> Path:
    """ds_mirrored, sharded, uninterrupted on 2 processes; sharded async backups every 4 steps."""
    tmp = tmp_path_factory.mktemp("sharded_reference")
    train(tmp, "ref", MIRRORED, warm=pair)
    return tmp


@pytest.fixture(scope="module")
def killed_in_write(tmp_path_factory: pytest.TempPathFactory, pair: WarmRanks) -> Path:
    """The same run, every rank killed inside the write of the step-8 backup (its part on disk, uncommitted)."""
    tmp = tmp_path_factory.mktemp("sharded_cut")
    train(tmp, "cut", {**MIRRORED, "kill_in_write_at_step": 8}, expect=DIED, warm=pair)
    return tmp


def tensor_bytes_per_file(folder: Path) -> dict[str, int]:
    """The tensor payload each DCP file of ``folder`` holds, from its ``.metadata`` (each file is one rank's write).

    Payload, not file size: DCP serializes each tensor with an overhead of its own, which dwarfs a small model's.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(folder).read_metadata()
    written: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        saved = metadata.state_dict_metadata[index.fqn]
        if isinstance(saved, TensorStorageMetadata):
            size = saved.size.numel() * saved.properties.dtype.itemsize
            written[info.relative_path] = written.get(info.relative_path, 0) + size
    return written


@pytest.mark.multiprocess
def test_every_rank_writes_its_part_and_nothing_is_gathered(reference: Path) -> None:
    """Each backup folder holds one DCP file per rank, each with about half the tensor bytes (DCP spreads the
    replicated tensors over the ranks). Control: the full layout, one file from rank 0, would fail every check."""
    backups = BackupStore(reference / "ref_backups", keep=2).backups()
    assert [step for step, _ in backups] == [8, 12]
    for _, folder in backups:
        assert (folder / META_FILENAME).is_file() and (folder / ".metadata").is_file()
        written = tensor_bytes_per_file(folder)
        assert sorted(written) == ["__0_0.distcp", "__1_0.distcp"], written
        total = sum(written.values())
        print(f"{folder.name}: tensor bytes per rank {written}")
        assert all(0.4 * total <= size <= 0.6 * total for size in written.values()), written


@pytest.mark.multiprocess
def test_a_kill_during_a_sharded_write_leaves_the_previous_backup_and_the_resume_is_exact(
    tmp_path: Path, reference: Path, killed_in_write: Path, pair: WarmRanks
) -> None:
    """Killed while writing the step-8 backup: step 4 stays the latest and resumes to the uninterrupted run's
    parameters (1e-6). Controls: the step-8 write had begun (its parts lie in the temporary folder), and the same
    resume with the optimizer state left fresh ends far off."""
    store = BackupStore(killed_in_write / "cut_backups", keep=2)
    temporary = store.temporary_folder(store.path_for(8))
    assert sorted(p.name for p in temporary.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert store.latest() == store.path_for(4) and is_sharded_checkpoint(store.path_for(4))
    control = tmp_path / "control"
    shutil.copytree(killed_in_write, control)
    train(killed_in_write, "cut", {**MIRRORED, "attempt": 1}, warm=pair)
    assert restored_step(killed_in_write, "cut") == 4
    assert not temporary.exists()  # the stale write is cleared at the restart
    exact = max_difference(final_params(reference, "ref"), final_params(killed_in_write, "cut"))
    train(control, "cut", {**MIRRORED, "attempt": 1, "skip_optimizer_restore": True}, warm=pair)
    fresh = max_difference(final_params(reference, "ref"), final_params(control, "cut"))
    print(f"sharded resume 2->2: max |diff| {exact:.2e}; optimizer state left fresh: {fresh:.2e}")
    assert exact <= 1e-6
    assert fresh > 1e-3


@pytest.mark.multiprocess
def test_a_sharded_backup_of_4_processes_resumes_on_2(tmp_path: Path, reference: Path, pair: WarmRanks) -> None:
    """Written by 4 ranks (batch 4: the same global batch of 16), killed at step 9, resumed on 2: the uninterrupted
    2-process run's parameters (1e-5). Control: the 4-rank folder holds 4 parts, read back by 2 ranks.

    The step-8 backup may or may not be committed when the kill comes (it is written in the background); the step-4
    one is, since the step-8 save waited for it.
    """
    train(tmp_path, "cut", {**MIRRORED, "devices": 4, "batch_size": 4, "die_at_step": 9}, expect=DIED)
    latest = BackupStore(tmp_path / "cut_backups", keep=2).latest()
    assert latest is not None and len(list(latest.glob("*.distcp"))) == 4
    train(tmp_path, "cut", {**MIRRORED, "attempt": 1}, warm=pair)
    assert restored_step(tmp_path, "cut") in (4, 8)
    difference = max_difference(final_params(reference, "ref"), final_params(tmp_path, "cut"))
    print(f"sharded resume 4->2: max |diff| {difference:.2e}")
    assert difference <= 1e-5


# --- consolidation into one file, resumed by a plain Trainer ---------------------------------------------------------


def _plain_resume(tmp: Path, checkpoint: Path) -> dict[str, torch.Tensor]:
    """A single-process Trainer (Lightning's own strategy) resumed from ``checkpoint`` to the end of epoch 2."""
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        # Positions the data where the backup stood (no backups in this empty folder).
        callbacks=[BackupAndRestore(str(tmp / "no_backups"), every_n_train_steps=None)],
    )
    model = Net()
    trainer.fit(model, DataLoader(make_data(N), batch_size=16, shuffle=True), ckpt_path=str(checkpoint))
    assert trainer.global_step == 12
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
def test_consolidate_checkpoint_turns_a_sharded_backup_into_a_file_a_plain_trainer_resumes(
    tmp_path: Path, reference: Path
) -> None:
    """``python -m lightning.pytorch.utilities.consolidate_checkpoint`` on the step-8 backup; a plain one-process
    Trainer resumes from the file to the 2-process run's parameters (1e-5), optimizer state included. Control: the
    same file with the optimizer state emptied ends far off."""
    folder = BackupStore(reference / "ref_backups", keep=2).path_for(8)
    output = tmp_path / "step8.ckpt"
    command = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(folder)]
    subprocess.run([*command, "--output_file", str(output)], cwd=REPO, env=worker_env(), check=True, timeout=120)
    checkpoint = torch.load(output, weights_only=False)
    assert next(iter(checkpoint["optimizer_states"][0]["state"])) == "net.0.0.weight"  # keyed by FQN
    exact = max_difference(final_params(reference, "ref"), _plain_resume(tmp_path, output))
    checkpoint["optimizer_states"][0]["state"] = {}
    fresh_file = tmp_path / "step8-fresh-optimizer.ckpt"
    torch.save(checkpoint, fresh_file)
    fresh = max_difference(final_params(reference, "ref"), _plain_resume(tmp_path, fresh_file))
    print(f"consolidated -> plain Trainer: max |diff| {exact:.2e}; optimizer state emptied: {fresh:.2e}")
    assert exact <= 1e-5
    assert fresh > 1e-3


# --- ds_parameter_server --------------------------------------------------------------------------------------------

PS = {
    "strategy": "ds_parameter_server",
    "devices": 1,  # one worker: fewer processes on 2 cores; the servers' state is what the checkpoint carries
    "max_epochs": 1,  # 12 steps
    "model": {"optimizer": "sgd", "lr": 0.05, "buffer": True},
    "strategy_kwargs": {"max_staleness": 0, "num_servers": 2, "min_shard_bytes": 1, **SHARDED},
    "backup": {"every_n_train_steps": 4, "keep": 3},
}


def tensor_entries_per_file(folder: Path) -> dict[str, set[str]]:
    """The tensor entries (flat key, first row) each DCP file of ``folder`` holds."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(folder).read_metadata()
    held: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            first_row = index.offset[0] if index.offset else 0
            held.setdefault(info.relative_path, set()).add(f"{index.fqn}@{first_row}")
    return held


@pytest.mark.multiprocess
def test_parameter_server_servers_write_their_rows_and_resume_exactly(tmp_path: Path) -> None:
    """Bulk-synchronous, 2 servers, one worker: each server writes its own rows of the parameters and the momentum
    (server s's file holds exactly the rows the shard plan gives it; server 0 also the buffer the chief sent), the
    chief only ``meta.pt``; restarted from the step-4 backup on 1 server, the run ends as the uninterrupted one
    (1e-6). Control: the same restart with the servers' momentum left fresh ends far off."""
    from ds_lightning.parameter_server.sharding import plan_shards

    train(tmp_path, "ref", PS)
    backup = BackupStore(tmp_path / "ref_backups", keep=3).path_for(4)
    assert is_sharded_checkpoint(backup)
    plan = plan_shards(dict(Net().named_parameters()), 2, min_shard_bytes=1)
    expected: dict[str, set[str]] = {"__0_0.distcp": {"model.marker@0"}, "__1_0.distcp": set()}
    for piece in plan.slices:
        for key in (f"model.{piece.name}", f"optimizer_0.state.{piece.name}.momentum_buffer"):
            expected[f"__{piece.server}_0.distcp"].add(f"{key}@{piece.rows[0]}")
    assert any(piece.rows[0] > 0 for piece in plan.slices)  # some parameters are split by rows across the servers
    assert tensor_entries_per_file(backup) == expected
    meta = torch.load(backup / META_FILENAME, weights_only=False)
    assert "state_dict" not in meta and "optimizer_states" not in meta
    assert meta["ds_parameter_server"]["updates"] == 4 and meta["ds_parameter_server"]["num_servers"] == 2
    momentum = read_part(SavedShards(backup, "optimizer_0"))["state"]
    assert momentum["net.0.0.weight"]["momentum_buffer"].shape == (16, 12)
    torch.testing.assert_close(read_part(SavedShards(backup, "model"))["marker"], torch.arange(5.0))
    one_server = {**PS, "strategy_kwargs": {**PS["strategy_kwargs"], "num_servers": 1}}  # type: ignore[dict-item]
    difference = {}
    for name, spec in (("resume", one_server), ("control", {**one_server, "skip_optimizer_restore": True})):
        shutil.copytree(backup, tmp_path / f"{name}_backups" / backup.name)  # the run's only backup: step 4
        train(tmp_path, name, spec)
        assert restored_step(tmp_path, name) == 4
        difference[name] = max_difference(final_params(tmp_path, "ref"), final_params(tmp_path, name))
    print(
        f"parameter server sharded resume (2 -> 1 servers): max |diff| {difference['resume']:.2e}; fresh momentum:"
        f" {difference['control']:.2e}"
    )
    assert difference["resume"] <= 1e-6
    assert difference["control"] > 1e-3


@pytest.mark.multiprocess
def test_a_save_before_the_first_step_changes_nothing_and_resumes_fresh(tmp_path: Path, pair: WarmRanks) -> None:
    """A sharded save as training starts (Adam, no step yet) leaves the run equal to one without it, holds no optimizer
    state, and a resume from it equals the run too. Control: creating the state the way torch's
    ``get_optimizer_state_dict`` does (a zero-lr step that Adam counts) ends far from the run."""
    spec = {**MIRRORED, "backup": {"every_n_train_steps": 100}, "max_epochs": 1}
    folder = tmp_path / "at_start.ckpt"
    train(tmp_path, "plain", spec, warm=pair)
    train(tmp_path, "saved", {**spec, "save_at_train_start": str(folder)}, warm=pair)
    assert is_sharded_checkpoint(folder)
    checkpoint = read_checkpoint(folder)
    assert checkpoint["global_step"] == 0
    assert not holds_optimizer_state(checkpoint["optimizer_states"][0])
    train(tmp_path, "resumed", {**spec, "ckpt_path": str(folder)}, warm=pair)
    train(tmp_path, "torch_state", {**spec, "state_at_train_start": True}, warm=pair)
    plain = final_params(tmp_path, "plain")
    saved = max_difference(plain, final_params(tmp_path, "saved"))
    resumed = max_difference(plain, final_params(tmp_path, "resumed"))
    control = max_difference(plain, final_params(tmp_path, "torch_state"))
    print(f"save before step 1: {saved:.2e}; resumed from it: {resumed:.2e}; torch's state creation: {control:.2e}")
    assert saved <= 1e-7
    assert resumed <= 1e-6
    assert control > 1e-4


# --- per-rank state: PowerSGD's error feedback -----------------------------------------------------------------------

POWERSGD = {
    **MIRRORED,
    "strategy_kwargs": {**SHARDED, "gradient_compression": "powersgd", "powersgd_rank": 1, "powersgd_start_iter": 2},
}


def entries_per_file(folder: Path, key: str) -> dict[str, set[str]]:
    """Which second-level keys under ``key`` each DCP file of ``folder`` holds (each file is one rank's write)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(folder).read_metadata()
    paths = metadata.planner_data or {}
    held: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        path = paths[index.fqn]
        if path[0] == key:
            held.setdefault(info.relative_path, set()).add(str(path[1]))
    return held


def params_of(path: Path) -> dict[str, torch.Tensor]:
    """The model of a checkpoint file or sharded folder."""
    if is_sharded_checkpoint(path):
        return dict(_load_distributed_checkpoint(path)["model"])
    return dict(torch.load(path, weights_only=False)["state_dict"])


@pytest.mark.multiprocess
def test_powersgd_error_feedback_is_written_per_rank_and_resumes_exactly(tmp_path: Path, pair: WarmRanks) -> None:
    """Each rank writes its own error feedback (rank r's entries lie in rank r's DCP file, ``meta.pt`` records only
    the setting); killed in the write of step 8 and resumed from step 4, the run equals the uninterrupted one (1e-6),
    and so does a full-checkpoint run resumed from that backup consolidated into one file. Control: the same resume
    with the error feedback dropped ends far off."""
    train(tmp_path, "ref", POWERSGD, warm=pair)
    train(tmp_path, "cut", {**POWERSGD, "kill_in_write_at_step": 8}, expect=DIED, warm=pair)
    backup = BackupStore(tmp_path / "cut_backups", keep=2).path_for(4)
    assert BackupStore(tmp_path / "cut_backups", keep=2).latest() == backup
    meta = torch.load(backup / META_FILENAME, weights_only=False)["ds_mirrored"]
    assert meta == {"gradient_compression": "powersgd", "world_size": 2}  # no state gathered into meta.pt
    assert entries_per_file(backup, "ds_mirrored_compression") == {
        "__0_0.distcp": {"rank_0"},
        "__1_0.distcp": {"rank_1"},
    }
    parts = read_part(SavedShards(backup, "ds_mirrored_compression"))
    errors = [torch.cat([e.flatten() for e in parts[f"rank_{r}"]["error"].values()]) for r in (0, 1)]
    assert all(int(parts[f"rank_{r}"]["iter"]) == 4 for r in (0, 1)) and all(e.abs().max() > 0 for e in errors)
    assert not torch.equal(errors[0], errors[1])  # the ranks' states differ: one gathered copy would not do
    consolidated = tmp_path / "step4.ckpt"
    command = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(backup)]
    subprocess.run([*command, "--output_file", str(consolidated)], cwd=REPO, env=worker_env(), check=True, timeout=120)
    control = tmp_path / "control"
    shutil.copytree(tmp_path, control, ignore=shutil.ignore_patterns("control"))

    train(tmp_path, "cut", {**POWERSGD, "attempt": 1}, warm=pair)
    assert restored_step(tmp_path, "cut") == 4
    full = {**POWERSGD["strategy_kwargs"], "state_dict_type": "full"}  # type: ignore[dict-item]
    spec = {**POWERSGD, "strategy_kwargs": full, "ckpt_path": str(consolidated), "backup": {"every_n_train_steps": 100}}
    train(tmp_path, "from_file", spec, warm=pair)
    train(control, "cut", {**POWERSGD, "attempt": 1, "skip_compression_restore": True}, warm=pair)
    reference = final_params(tmp_path, "ref")
    exact = max_difference(reference, final_params(tmp_path, "cut"))
    from_file = max_difference(reference, params_of(tmp_path / "from_file.ckpt"))
    dropped = max_difference(reference, final_params(control, "cut"))
    print(f"PowerSGD sharded resume: {exact:.2e}; consolidated: {from_file:.2e}; error feedback dropped: {dropped:.2e}")
    assert exact <= 1e-6
    assert from_file <= 1e-6
    assert dropped > 1e-4
