"""One fault-benchmark run: the digits MLP on 2 CPU processes with (or without) ``BackupAndRestore``; rank 0's events
go to ``<stamp_dir>/stamps.jsonl`` (wall clock, so two launches line up). See ``README.md``.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the imports: a restart pays for them

import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ds_lightning  # noqa: E402
from benchmarks.harness.trainer import quiet_trainer  # noqa: E402
from ds_lightning.callbacks import BackupAndRestore  # noqa: E402
from ds_lightning.demos import DigitsClassifier, DigitsDataModule  # noqa: E402

IMPORTED = time.time()


class Stamps(Callback):
    """Every step's end, and rank 0's events. At the end of step ``kill_at`` (once: the ``killed`` marker) rank 0 kills
    its process group, or rank ``kill_rank`` only itself (the others meet its absence in their next collective)."""

    def __init__(self, stamp_dir: str | None, kill_at: int | None, kill_rank: int | None = None) -> None:
        self.path = Path(stamp_dir, "stamps.jsonl") if stamp_dir else None
        self.kill_at, self.kill_rank = kill_at, kill_rank
        self.ends: list[float] = []

    def _note(self, trainer: pl.Trainer, event: str, any_rank: bool = False, **extra: Any) -> None:
        if self.path is None or (trainer.global_rank != 0 and not any_rank):
            return
        line = {"event": event, "t": time.time(), "pid": os.getpid(), "step": trainer.global_step, **extra}
        with self.path.open("a") as f:  # one write per line: a kill leaves whole lines behind
            f.write(json.dumps(line) + "\n")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The process group is up; BackupAndRestore's own setup (which reads the backup) runs after this one.
        self._note(trainer, "process_start", t_process=PROCESS_START, t_imported=IMPORTED)
        self._note(trainer, "setup")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note(trainer, "train_start")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._note(trainer, "failed", error=f"{type(exception).__name__}: {exception}"[:300])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())
        if self.path is None:
            return
        self._note(trainer, "step")
        marker = self.path.parent / "killed"
        if self.kill_at is None or trainer.global_step < self.kill_at or marker.exists():
            return
        whole_group = self.kill_rank is None
        if trainer.global_rank == (0 if whole_group else self.kill_rank):
            marker.write_text(str(trainer.global_step))
            self._note(trainer, "kill", **({} if whole_group else {"any_rank": True, "rank": trainer.global_rank}))
            if whole_group:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def _timed(owner: Any, name: str, into: list[float]) -> None:
    fn = getattr(owner, name)  # each call's duration (ms) goes into `into`

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(1000 * (time.perf_counter() - start))

    setattr(owner, name, wrapper)


STRATEGIES = {
    "ds_mirrored": lambda timeout: ds_lightning.MirroredStrategy(timeout=timeout),
    "ds_pipeline": lambda timeout: ds_lightning.PipelineStrategy(n_microbatches=2, timeout=timeout),
    "ds_parameter_server": lambda t: ds_lightning.ParameterServerStrategy(max_staleness=0, num_servers=1, timeout=t),
}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pl.seed_everything(spec["seed"], verbose=False)
    stamps = Stamps(spec.get("stamp_dir"), spec.get("kill_at"), spec.get("kill_rank"))
    callbacks: list[Callback] = [stamps]
    times: dict[str, list[float]] = {}
    backup = spec.get("backup")
    if backup:
        kwargs = {"every_n_train_steps": backup["every"], "keep": 2, "async_save": backup["async"]}
        callbacks.append(BackupAndRestore(spec["backup_dir"], **kwargs))
        # Rank 0's wait in save (on the loop), and its file write (in a thread when async), which lives in the store.
        times = {"save_ms": [], "write_ms": []}
        _timed(callbacks[-1], "save", times["save_ms"])
        _timed(callbacks[-1]._store, "write", times["write_ms"])
    data = DigitsDataModule(batch_size=spec["batch_size"], seed=0)
    data.setup("fit")
    assert data.train_set is not None
    strategy = STRATEGIES[spec["strategy"]](spec["dist_timeout"])
    # devices: 1 per task in the namespace cluster, where TF_CONFIG gives the rest
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=spec.get("devices", 2),
        strategy=strategy,
        max_steps=spec["max_steps"],
        callbacks=callbacks,
    )
    loader = DataLoader(data.train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=True)
    model = DigitsClassifier(hidden_sizes=spec["hidden"], lr=0.01)
    model.train_acc.sync_on_compute = False  # nothing reads it; no collective at every epoch end
    trainer.fit(model, train_dataloaders=loader)  # no ckpt_path: BackupAndRestore resumes on its own
    if getattr(trainer.strategy, "is_server", False):
        sys.stdout.flush()
        os._exit(0)
    if trainer.global_rank != 0:
        return
    # Step end to step end: the backup's blocking part is inside, wherever the callback runs it.
    timed = [1000 * (b - a) for a, b in itertools.pairwise(stamps.ends)][spec.get("warmup", 0) :]
    record = {
        "params": sum(p.numel() for p in model.parameters()),
        "last_step": trainer.global_step,
        "mean_step_ms": statistics.fmean(timed) if timed else None,
        "median_step_ms": statistics.median(timed) if timed else None,
        "max_step_ms": max(timed) if timed else None,
        "backups": sorted(p.name for p in Path(spec["backup_dir"]).glob("*.ckpt")) if backup else [],
        **{k: statistics.median(v) if v else None for k, v in times.items()},
    }
    Path(spec["out_dir"], "result.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
