"""One short fit per ds strategy or ds_mirrored feature, chosen by name: ``python .ci/strategy_smoke.py ds_pipeline``.

Part of ``.ci/versions``: it checks that each strategy still trains on a given Lightning/torch pair, and so do the
features that lean hardest on torch and Lightning internals: ds_mirrored's optimizer-state sharding (both engines), its
two-level all-reduce (2 simulated hosts of 2 processes, as tests/strategies/test_mirrored_hierarchical.py runs them),
``gradient_compression="auto"``, and a ``BackupAndRestore`` backup restored after a crash. Each feature check also
shows the feature was on. Exits non-zero (with the traceback or the reason) when a fit fails, takes no optimizer step,
or runs without its feature. Run it from any folder with this repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

import ds_lightning
from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from ds_lightning.testing.processes import free_port
from tests.helpers.backup_runs import DIED
from tests.helpers.trainers import quiet_trainer

STEPS = 3
TIMEOUT = timedelta(seconds=120)  # a collective that hangs fails the check well inside .ci/versions' 300 s
HOST = "DS_SMOKE_HOST"  # set in the two "hosts" of the two-level check (each one's second process inherits it)


def fit(strategy: Any, devices: int, num_nodes: int = 1, optimizer: str = "sgd") -> pl.Trainer:
    """Fit the digits classifier for ``STEPS`` steps and check that it stepped."""
    pl.seed_everything(0, workers=True)
    trainer = quiet_trainer(
        Path.cwd(),
        [],
        strategy=strategy,
        devices=devices,
        num_nodes=num_nodes,
        max_epochs=1,
        limit_train_batches=STEPS,
        limit_val_batches=1,
    )
    trainer.fit(DigitsClassifier(hidden_sizes=[32, 32], optimizer=optimizer), DigitsDataModule(batch_size=32))
    if trainer.global_step < 1:
        raise SystemExit(f"fit took no optimizer step (global_step={trainer.global_step})")
    return trainer


def on_rank_zero(trainer: pl.Trainer, detail: str) -> str | None:
    """What a check prints: ``detail`` on global rank 0, nothing on the others."""
    return detail if trainer.is_global_zero else None


def plain(name: str, devices: int) -> Callable[[], str | None]:
    """The check of strategy ``name`` with its defaults, on ``devices`` processes."""

    def check() -> str | None:
        trainer = fit(name, devices)
        return on_rank_zero(trainer, f"global_step={trainer.global_step}")

    return check


def sharded(engine: str) -> str | None:
    """Optimizer-state sharding: each rank's Adam holds part of the state (fsdp2: DTensor shards; zero: a wrapper)."""
    strategy = ds_lightning.MirroredStrategy(timeout=TIMEOUT, shard_optimizer_state=True, sharding_engine=engine)
    trainer = fit(strategy, 2, optimizer="adam")
    (optimizer,) = trainer.optimizers
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kind = type(params[0]).__name__ if engine == "fsdp2" else type(optimizer).__name__
    expected = "DTensor" if engine == "fsdp2" else "ZeroRedundancyOptimizer"
    if kind != expected:
        raise SystemExit(f"sharding_engine={engine!r}: the optimizer works on {kind}, not {expected}: nothing sharded")
    return on_rank_zero(trainer, f"global_step={trainer.global_step} {kind}")


def auto_compression() -> str | None:
    """``gradient_compression="auto"``: the hook ran and decided (a probe every 2 synchronisations)."""
    strategy = ds_lightning.MirroredStrategy(timeout=TIMEOUT, gradient_compression="auto", auto_interval=2)
    trainer = fit(strategy, 2)
    auto = trainer.strategy.auto_compression
    if auto is None or auto.step < 1 or not auto.decisions:
        raise SystemExit(f"gradient_compression='auto' never ran or never decided: {auto}")
    return on_rank_zero(trainer, f"global_step={trainer.global_step} choice={auto.choice} ({len(auto.decisions)})")


def two_level() -> str | None:
    """``hierarchical=True`` on 2 simulated hosts x 2 processes: only each host's leader sends across hosts."""
    if HOST not in os.environ:  # the driver: one launch per host, as separate machines would start them
        env = {**os.environ, HOST: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        hosts = [
            subprocess.Popen([sys.executable, __file__, "ds_mirrored-hierarchical"], env={**env, "NODE_RANK": str(n)})
            for n in range(2)
        ]
        try:
            codes = [host.wait(timeout=240) for host in hosts]
        finally:
            for host in hosts:
                host.kill()
        if codes != [0, 0]:
            raise SystemExit(f"the hosts exited with {codes}")
        return "2 hosts x 2 processes"
    strategy = ds_lightning.MirroredStrategy(timeout=TIMEOUT, hierarchical=True)
    trainer = fit(strategy, 2, num_nodes=2)
    sent = trainer.strategy.comm_bytes_per_step
    if (sent > 0) != (trainer.local_rank == 0):  # a flat ring would have every rank send
        raise SystemExit(f"rank {trainer.global_rank} (local {trainer.local_rank}) sent {sent} bytes across hosts")
    return on_rank_zero(trainer, f"global_step={trainer.global_step}, bytes across hosts from rank 0: {sent:.0f}")


def backup_restore() -> str:
    """A 2-process ds_mirrored run dies at step 5 (every rank, as a crash); the same command resumes.

    It must resume from its backup of step 4 and end at step 12, as the uninterrupted run would
    (``tests/helpers/backup_runs.py`` runs both).
    """
    out = Path.cwd() / "backup"
    spec: dict[str, Any] = {"out": str(out), "backup_dir": str(out) + "-backups", "n": 96, "max_epochs": 2}
    spec["backup"] = {"every_n_train_steps": 2, "async_save": False}
    for attempt, extra, expected in ((0, {"die_at_step": 5}, DIED), (1, {}, 0)):
        path = Path.cwd() / f"backup-{attempt}.json"
        path.write_text(json.dumps({**spec, **extra, "attempt": attempt}))
        code = subprocess.run([sys.executable, "-m", "tests.helpers.backup_runs", str(path)], timeout=240).returncode
        if code != expected:
            raise SystemExit(f"attempt {attempt} exited with {code}, expected {expected}")
    summary = json.loads(Path(f"{out}.json").read_text())
    restored = summary["restored_from"]
    if restored is None or not restored.endswith("backup-step000000004.ckpt") or summary["global_step"] != 12:
        raise SystemExit(f"the restart did not resume from step 4's backup and finish at step 12: {summary}")
    return f"resumed from {Path(restored).name}, global_step={summary['global_step']}"


# ds_model_parallel splits the model inside one process; the others run 2.
SMOKES: dict[str, Callable[[], str | None]] = {
    "ds_mirrored": plain("ds_mirrored", 2),
    "ds_pipeline": plain("ds_pipeline", 2),
    "ds_model_parallel": plain("ds_model_parallel", 1),
    "ds_parameter_server": plain("ds_parameter_server", 2),
    "ds_mirrored-zero": lambda: sharded("zero"),
    "ds_mirrored-fsdp2": lambda: sharded("fsdp2"),
    "ds_mirrored-auto": auto_compression,
    "ds_mirrored-hierarchical": two_level,
    "backup-restore": backup_restore,
}


def main(name: str) -> None:
    """Run check ``name``; print ``SMOKE OK`` with what it saw (on global rank 0), or exit non-zero."""
    if name not in SMOKES:
        raise SystemExit(f"unknown check {name!r}; choose one of {sorted(SMOKES)}")
    detail = SMOKES[name]()
    if detail is not None:
        print(f"SMOKE OK {name} {detail}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
