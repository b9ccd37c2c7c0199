"""``ds_mirrored``'s sharding engines with ``state_dict_type="sharded"``: ZeRO-1 (``zero``), ``fsdp2`` and ZeRO-3
(``shard_parameters=True, cpu_offload=True``) write each rank's own part with DCP and resume from it exactly, at the
same world size, from 4 processes onto 2, and under another engine.

Two launches (tests/helpers/mirrored_sharded_runs.py: real gloo processes, every rank's exit code checked), each
running several fits in turn: 4 processes (every engine to step 5, a sharded backup at step 4), then 2 processes
(every engine uninterrupted, with a backup every 4 steps; then the resumes and their controls). Every resume has a
control: the same resume with the optimizer state left fresh ends far off.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonargparse import ArgumentParser
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from ds_lightning.backup import BackupStore
from ds_lightning.checkpoint import ShardedGroup, is_sharded_checkpoint, load_into, save_sharded
from ds_lightning.checkpoint.layout import SavedShards, split_checkpoint
from ds_lightning.sharding.sharded_checkpoints import owned_targets
from ds_lightning.strategies import MirroredStrategy
from tests.helpers.backup_runs import Net
from tests.helpers.mirrored_sharded_runs import ENGINES, STEPS, final_params, max_difference, tensor_bytes_per_file
from tests.helpers.runner import run_ranks

#: (the engine that wrote a checkpoint on 4 processes, the engine that resumes it on 2), both ways between ZeRO-1's
#: whole tensors per rank and FSDP2's DTensor shards.
CROSS = (("fsdp2", "zero"), ("zero", "zero3"))
FAR = 1e-3  # a control's least distance from the uninterrupted run
WALL: dict[str, float] = {}


def test_state_dict_type_is_a_typed_keyword_of_mirrored_strategy() -> None:
    """Explicit in the signature, so LightningCLI lists and checks it; control: a value outside the Literal fails."""
    parameter = inspect.signature(MirroredStrategy.__init__).parameters["state_dict_type"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default == "full"
    parser = ArgumentParser()
    parser.add_class_arguments(MirroredStrategy, "strategy")
    parsed = parser.parse_args(["--strategy.state_dict_type=sharded", "--strategy.shard_parameters=true"])
    assert parsed.strategy.state_dict_type == "sharded"
    strategy = MirroredStrategy(shard_optimizer_state=True, sharding_engine="zero", state_dict_type="sharded")
    assert strategy.state_dict_type == "sharded"
    with pytest.raises(SystemExit):
        parser.parse_args(["--strategy.state_dict_type=shard"])


def test_a_zero_rank_reads_only_the_state_it_owns(tmp_path: Path) -> None:
    """The load targets a ZeRO-1 rank builds from a folder's metadata: zero tensors of the saved shapes and dtypes for
    the FQNs it owns (no optimizer step), and every param group's entries. Control: another rank's FQNs are absent."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    folder = tmp_path / "step1.ckpt"
    state, meta = split_checkpoint({"optimizer_states": [get_optimizer_state_dict(model, optimizer)]})
    save_sharded(state, meta, folder, ShardedGroup(no_dist=True))
    targets = owned_targets(SavedShards(folder, "optimizer_0"), owned={"1.weight"})
    assert list(targets["state"]) == ["1.weight"]
    owned = targets["state"]["1.weight"]
    assert owned["exp_avg"].shape == (2, 3) and owned["step"].shape == () and not owned["exp_avg"].any()
    assert len(targets["param_groups"]) == 1 and {"lr", "betas", "params"} <= targets["param_groups"][0].keys()
    assert "0.weight" not in targets["state"]
    load_into({"optimizer_0": targets}, folder, ShardedGroup(no_dist=True))
    torch.testing.assert_close(owned["exp_avg"], optimizer.state[model[1].weight]["exp_avg"], rtol=0, atol=0)
    assert targets["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]


def _launch(out: Path, name: str, world_size: int, arms: list[dict[str, Any]]) -> None:
    spec = out / f"{name}.json"
    spec.write_text(json.dumps({"world_size": world_size, "arms": [{"out": str(out), **arm} for arm in arms]}))
    start = time.monotonic()
    run = run_ranks("tests.helpers.mirrored_sharded_runs", [str(spec)], world_size, timeout=280)
    WALL[name] = time.monotonic() - start
    run.assert_every_rank_exits(0)


def _backup(out: Path, name: str, step: int) -> Path:
    folder = BackupStore(out / f"{name}_backups", keep=STEPS).path_for(step)
    assert is_sharded_checkpoint(folder), f"{folder} is not a complete sharded backup"
    return folder


def _resume(name: str, source: Path, engine: str) -> list[dict[str, Any]]:
    """A resume of ``source`` under ``engine`` and its control (the optimizer state left fresh)."""
    arm = {"engine": engine, "ckpt_path": str(source)}
    return [{"name": name, **arm}, {"name": f"{name}_control", **arm, "fresh_optimizer": True}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mirrored_sharded")
    four = [{"name": f"four_{e}", "engine": e, "backup_every": 4, "max_steps": 5} for e in ENGINES]
    _launch(out, "four", 4, four)
    arms: list[dict[str, Any]] = [{"name": f"ref_{e}", "engine": e, "backup_every": 4} for e in ENGINES]
    for engine in ENGINES:
        # The uninterrupted run's step-4 backup: its arm above runs first in the same launch.
        same = out / f"ref_{engine}_backups" / "backup-step000000004.ckpt"
        arms += _resume(f"same_{engine}", same, engine)
        arms += _resume(f"four_to_two_{engine}", _backup(out, f"four_{engine}", 4), engine)
    for writer, reader in CROSS:
        arms += _resume(f"cross_{writer}_to_{reader}", _backup(out, f"four_{writer}", 4), reader)
    _launch(out, "two", 2, arms)
    print(f"wall seconds: 4 processes {WALL['four']:.1f}, 2 processes {WALL['two']:.1f} ({len(arms)} fits)")
    return out


def _distance(out: Path, name: str, reference: str) -> tuple[float, float]:
    """How far the resume ``name`` and its control end from the uninterrupted run ``reference``."""
    ref = final_params(out / f"{reference}.ckpt")
    assert json.loads((out / f"{name}.json").read_text())["global_step"] == STEPS
    return max_difference(ref, final_params(out / f"{name}.ckpt")), max_difference(
        ref, final_params(out / f"{name}_control.ckpt")
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_engine_resumes_its_own_sharded_backup_exactly(runs: Path, engine: str) -> None:
    """From the step-4 backup of the uninterrupted 2-process run to its end: its parameters (1e-6)."""
    exact, control = _distance(runs, f"same_{engine}", f"ref_{engine}")
    print(f"{engine} 2->2: max |diff| {exact:.2e}; optimizer state left fresh: {control:.2e}")
    assert exact <= 1e-6
    assert control > FAR


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_engine_resumes_a_4_process_backup_on_2(runs: Path, engine: str) -> None:
    """Written by 4 ranks (batch 4, the same global batch of 16), resumed by 2: the 2-process run's parameters."""
    exact, control = _distance(runs, f"four_to_two_{engine}", f"ref_{engine}")
    print(f"{engine} 4->2: max |diff| {exact:.2e}; optimizer state left fresh: {control:.2e}")
    assert exact <= 1e-5
    assert control > FAR


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("writer", "reader"), CROSS)
def test_a_backup_resumes_under_another_engine(runs: Path, writer: str, reader: str) -> None:
    """Written by one engine on 4 ranks, resumed by another on 2: the reader's uninterrupted run (1e-5)."""
    exact, control = _distance(runs, f"cross_{writer}_to_{reader}", f"ref_{reader}")
    print(f"{writer} (4) -> {reader} (2): max |diff| {exact:.2e}; optimizer state left fresh: {control:.2e}")
    assert exact <= 1e-5
    assert control > FAR


def _adam_state_bytes() -> int:
    """A whole Adam state of the test model: exp_avg and exp_avg_sq per parameter, and a float32 step."""
    return sum(2 * p.numel() * p.element_size() + 4 for p in Net().parameters())


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_rank_writes_its_own_part_of_the_optimizer_state(runs: Path, engine: str) -> None:
    """Each rank's DCP file holds a share of the optimizer state, no file all of it, and together they hold the whole
    state once: nothing was gathered on rank 0. Control: the check sees the whole state (the bytes add up)."""
    for world_size, folder in ((4, _backup(runs, f"four_{engine}", 4)), (2, _backup(runs, f"ref_{engine}", 8))):
        written = tensor_bytes_per_file(folder, "optimizer_0")
        total = sum(written.values())
        print(f"{engine} on {world_size}: optimizer-state bytes per rank's file {written}")
        assert sorted(written) == [f"__{rank}_0.distcp" for rank in range(world_size)], written
        assert all(0 < size <= 0.75 * total for size in written.values()), written
        # Once each: DCP writes a replicated tensor (fsdp2's step counters) once, a rank's own tensors from that rank.
        assert total == _adam_state_bytes(), (total, _adam_state_bytes())
