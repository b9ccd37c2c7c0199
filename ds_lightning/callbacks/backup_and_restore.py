"""``BackupAndRestore``: back the run up as it trains, and resume it exactly when it starts again."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.backup.agreement import StepAgreement
from ds_lightning.backup.position import (
    attach_loader_states,
    detach_loader_states,
    draw_as_the_next_epoch_starts,
    move_batch_counters,
    random_states,
    set_random_states,
)
from ds_lightning.backup.preemption import PreemptionWatch
from ds_lightning.backup.requeue import SlurmRequeue
from ds_lightning.backup.store import BackupStore
from ds_lightning.backup.writer import BackupWriter
from ds_lightning.callbacks._batch_geometry import data_parallel_size, samples_per_micro_step
from ds_lightning.data.resumable import DataCursor, ResumableDataLoader, position_under
from ds_lightning.strategies.capabilities import capabilities_of

__all__ = ["BackupAndRestore"]

log = logging.getLogger(__name__)

#: The checkpoint entry holding what Lightning does not save: the sample reached and every rank's random states.
CHECKPOINT_KEY = "ds_backup"
_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT", "SIGUSR2", "SIGHUP")
_FLAGS = 3  # agreed at every step: a timed backup is due, preempted, preempted by the requeue signal


class BackupAndRestore(Callback):
    """Back training up every few steps; when ``fit`` starts and ``backup_dir`` holds a backup, go on from it.

    The resumed run is the interrupted one: model, optimizers, LR schedulers, loop counters, every rank's random
    states, the sample reached inside the epoch, and every ds_lightning state that the strategy and callbacks save
    (PowerSGD memory, the load balancer's plan, the LR-scaling factor, the loss scaler, the parameter servers' shards
    and clocks, the pipeline's stages) come back, with no ``ckpt_path`` and no code from the user. Every sample is
    still used once per epoch: the epoch's order depends on the seed and the epoch only, and the position is kept in
    samples, so a backup also resumes on another number of processes (keep the global batch with
    ``GradientAccumulation(global_batch_size=...)`` to continue the same training), and under another strategy:
    Lightning's own (the default one-device strategy, ``ddp``) have their training data positioned the same way.

    Backups are taken after an optimizer step, written to a temporary name, synced and renamed, so a process killed
    mid-write leaves the previous backup whole; the newest ``keep`` are kept. With ``async_save`` the loop only waits
    for a copy of the state in host memory, and a thread writes the file.

    Under a strategy with ``state_dict_type="sharded"`` a backup is a folder (Lightning FSDP's sharded layout) that
    every rank writes its own part of with ``torch.distributed.checkpoint`` (``async_save`` with ``async_save=True``,
    its collectives on a gloo group of their own), committed by rank 0's rename once every part is in: nothing is
    gathered on rank 0, and a kill mid-write still leaves the previous backup the latest.

    Preemption: on SIGTERM or SIGUSR1 (what Kubernetes and SLURM send before stopping a job) every rank takes a
    backup at the optimizer step after the next one (a step all ranks agree on without waiting for each other), then
    the process exits with ``exit_code``; if that has not happened within ``grace_seconds``, it exits anyway and the
    previous backup stands.

    On SLURM with Lightning's auto-requeue on (``SLURMEnvironment(auto_requeue=True)``, the default there), this
    callback handles the requeue signal (SIGUSR1, or the environment's ``requeue_signal``) in place of Lightning's own
    handler, which is then never registered: after the backup, rank 0 runs ``scontrol requeue`` for the job, as
    Lightning would, and the requeued job resumes from the backup. SIGTERM backs up too, and requeues only when SLURM
    is preempting the job (a job that ends inside its ``GraceTime`` is not requeued by SLURM); after ``scancel`` the
    job ends. With ``auto_requeue=False`` nothing requeues: the job script decides on ``exit_code``.

    ``backup_dir`` must be the same directory for every process (shared storage across hosts). Under
    ``ds_parameter_server`` the chief writes the backups, with the servers' state; an asynchronous run resumes from
    its last backup but is not bit-exact.

    Args:
        backup_dir: where the backups live.
        every_n_train_steps: back up after every n-th optimizer step; ``None`` for none by step count.
        every_n_seconds: also back up when this long has passed since the last backup (rank 0's clock decides).
        keep: how many of the newest backups to keep.
        async_save: write the file in a background thread.
        grace_seconds: the longest a preempted process keeps running after the signal.
        exit_code: the code a preempted process exits with (42, as TensorFlow's preemption handler; a SLURM job
            script can requeue on it).
        signals: the signals that mean preemption.

    Raises:
        ValueError: for an out-of-range option, naming the value and the fix.

    """

    def __init__(
        self,
        backup_dir: str,
        every_n_train_steps: int | None = 100,
        every_n_seconds: float | None = None,
        keep: int = 2,
        async_save: bool = True,
        grace_seconds: float = 30.0,
        exit_code: int = 42,
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
    ) -> None:
        if not isinstance(backup_dir, str) or not backup_dir:
            raise ValueError(f"backup_dir={backup_dir!r} must name a directory, e.g. BackupAndRestore('backups/run1').")
        check.optional_integer(
            "every_n_train_steps", every_n_train_steps, 1, "BackupAndRestore(backup_dir, every_n_train_steps=100)"
        )
        if every_n_seconds is not None:
            check.number("every_n_seconds", every_n_seconds, "BackupAndRestore(dir, every_n_seconds=600)", above=0)
        check.integer("keep", keep, 1, "BackupAndRestore(backup_dir, keep=2)")
        check.number("grace_seconds", grace_seconds, "BackupAndRestore(backup_dir, grace_seconds=30)", above=0)
        check.flag("async_save", async_save)
        if not check.is_int(exit_code) or not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code={exit_code!r} must be a process exit code in 0..255, e.g. exit_code=42.")
        unknown = [s for s in signals if s not in _SIGNALS]
        if unknown:
            raise ValueError(f"signals={list(signals)!r} names {unknown}; choose among {list(_SIGNALS)}.")
        self.backup_dir = backup_dir
        self.every_n_train_steps = every_n_train_steps
        self.every_n_seconds = every_n_seconds
        self.keep = keep
        self.async_save = async_save
        self.grace_seconds = float(grace_seconds)
        self.exit_code = exit_code
        self.signals = tuple(signals)
        self.restored_from: str | None = None  # the backup this fit resumed from
        self.backups_taken = 0
        self._store = BackupStore(backup_dir, keep)
        self._writer = BackupWriter(self._store, async_save)
        self._watch = PreemptionWatch([signal.Signals[s] for s in self.signals], self.grace_seconds, exit_code)
        self._cursor = DataCursor()
        self._agreement = StepAgreement()
        self._restored: dict[str, Any] | None = None
        self._requeue: SlurmRequeue | None = None
        # Samples of the current epoch trained so far, counted here: Lightning's batch counters of a run that was
        # itself restored do not always start where that run's data did.
        self._epoch_counted: int | None = None
        self._samples = 0
        self._resume: tuple[int, int] | None = None
        self._active = False
        self._unposition: Callable[[], None] | None = None
        self._last_step = 0
        self._last_time = 0.0

    # --- start: find the backup and have Lightning restore it ------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        self._active = stage == "fit" and not getattr(strategy, "is_server", False)  # servers get state from the chief
        if not self._active:
            return
        # Run after every other callback, so a backup holds what they recorded for the step.
        # Lightning's callback connector sets Trainer.callbacks (a list), which the Trainer class does not declare.
        trainer.callbacks = [c for c in trainer.callbacks if c is not self] + [self]  # type: ignore[attr-defined]
        if hasattr(strategy, "data_cursor"):
            strategy.data_cursor = self._cursor
        else:  # Lightning's own strategies (the default one-device strategy, ddp): the same order, positioned here
            self._unposition = position_under(strategy, self._cursor)
        self._requeue = SlurmRequeue.of(getattr(strategy, "cluster_environment", None))
        watched = [signal.Signals[s] for s in self.signals]
        if self._requeue is not None:
            watched += [self._requeue.signal] if self._requeue.signal not in watched else []
            rank_zero_info(f"BackupAndRestore: {self._requeue.describe()}")
        self._watch.signals = tuple(watched)
        # From here on a preemption signal only raises the flag, also while the backup loads (the handlers go in again
        # over Lightning's, which it registers after the restore; it skips a requeue signal that has ours already).
        self._watch.received = None
        self._watch.install()
        timeout = getattr(strategy, "_timeout", None)  # Lightning's DDP keeps it there too
        self._writer.timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        self._agreement.timeout = self._writer.timeout
        self._writer.async_group = self._async_group(trainer, timeout)
        self._agreement.reset()
        self._cursor.clear()
        self._restored, self.restored_from = None, None
        self._epoch_counted, self._samples, self._resume = None, 0, None
        latest = self._store.latest()
        if trainer.is_global_zero:
            self._store.remove_stale_temporaries()
        if latest is not None:
            rank_zero_info(f"BackupAndRestore: resuming from {latest}")
            # Lightning loads a checkpoint only from fit(ckpt_path=...), decided before any hook runs; preloading it
            # here makes the restore that follows use it (docs/lightning-private-api.md).
            trainer._checkpoint_connector.resume_start(str(latest))
            self.restored_from = str(latest)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if not self._active or saved is None:
            return
        attach_loader_states(checkpoint, saved.get("loader_states"))
        self._restored = saved
        if not saved["epoch_complete"]:
            self._cursor.resume_at(saved["epoch"], saved["samples"])
            self._resume = (saved["epoch"], saved["samples"])

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            self._watch.install()  # over Lightning's (see on_train_start), before the sanity check's collectives

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._last_step, self._last_time = trainer.global_step, time.monotonic()
        # Again: Lightning installs its SIGTERM handler after the restore, just before the loops, and that handler
        # broadcasts inside the signal handler (a collective the other ranks never join when the signal reaches one).
        self._watch.install()
        if self.restored_from is not None and trainer.ckpt_path not in (None, self.restored_from):
            rank_zero_warn(
                f"fit(ckpt_path={trainer.ckpt_path!r}) was restored instead of the backup {self.restored_from}; drop"
                " ckpt_path to resume from the backups."
            )
            return
        saved = self._restored
        if saved is None:
            return
        per_step = samples_per_micro_step(trainer, "BackupAndRestore")
        if per_step != saved["micro_batch_samples"]:  # another world size: batches of another size
            done = trainer.num_training_batches if saved["epoch_complete"] else saved["samples"] // per_step
            move_batch_counters(trainer, int(done))
        states = saved["random_states"]
        set_random_states(states[trainer.global_rank % len(states)])
        if saved["epoch_complete"]:
            draw_as_the_next_epoch_starts(trainer.train_dataloader)
        rank_zero_info(
            f"BackupAndRestore: resumed at step {trainer.global_step}, epoch {trainer.current_epoch}, sample"
            f" {saved['samples']} of the epoch (saved by {saved['world_size']} process(es), now"
            f" {data_parallel_size(trainer)} data-parallel)"
        )

    # --- what the backup holds beyond Lightning's own state ----------------------------------------------------------

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self._active:
            return
        per_step = samples_per_micro_step(trainer, "BackupAndRestore")
        samples = self._samples if self._epoch_counted == trainer.current_epoch else 0
        checkpoint[CHECKPOINT_KEY] = {
            "epoch": trainer.current_epoch,
            "samples": samples,
            # The data ran out: the next run starts the next epoch.
            # (A count that reached the epoch's end without it is resumed as zero batches left.)
            "epoch_complete": bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch),
            "micro_batch_samples": per_step,
            "world_size": data_parallel_size(trainer),
            "random_states": _gather(trainer, random_states()),
            # Out of Lightning's part, so that a Trainer without this callback loads the checkpoint too.
            "loader_states": detach_loader_states(checkpoint, _trains_from_ours(trainer.train_dataloader)),
        }

    # --- taking backups ----------------------------------------------------------------------------------------------

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._active:
            return
        self._count_samples(trainer)
        if trainer.global_step == self._last_step:
            return  # inside an accumulation window: not a point the run can resume from
        self._last_step = step = trainer.global_step
        # Raised by any rank at the previous optimizer step: every rank acts on them here, at this same step.
        timed, preempted, requeue = self._agreement.collect(_FLAGS)
        due = self.every_n_train_steps is not None and step % self.every_n_train_steps == 0
        if due or timed or preempted:
            self.save(trainer)
        if preempted:
            self._writer.wait()
            # Said before a requeue: SLURM stops the job's processes as soon as it takes the job back.
            rank_zero_info(f"BackupAndRestore: preempted; backed up at step {step}, exiting with code {self.exit_code}")
            if self._requeue is not None:
                self._requeue_job(trainer, asked=requeue)
            raise SystemExit(self.exit_code)
        # After the save, which restarts the timer: a timed backup is not taken twice.
        timer = (
            self.every_n_seconds is not None
            and trainer.is_global_zero  # rank 0's clock decides: the others' timers would add backups of their own
            and time.monotonic() - self._last_time >= self.every_n_seconds
        )
        received = self._watch.received
        flags = (timer, received is not None, self._requeue is not None and received == self._requeue.signal)
        self._agreement.start(flags, trainer.strategy.root_device, collective=_collective(trainer))

    def _requeue_job(self, trainer: pl.Trainer, asked: bool) -> None:
        """Rank 0 requeues the SLURM job once the backup is written, if the requeue signal ``asked`` or SLURM preempts.

        Every other rank waits for rank 0 to have done so.
        """
        assert self._requeue is not None
        if trainer.is_global_zero and (asked or self._requeue.preempted()):
            rank_zero_info(f"BackupAndRestore: requeueing SLURM job {self._requeue.job_id} (scontrol requeue)")
            self._requeue.requeue()  # a failure is logged; the backup stands for the next submission
        if _collective(trainer):
            # A job whose tasks have all exited ends instead of being requeued (and srun --kill-on-bad-exit would end
            # rank 0 on the first exit): nobody leaves before rank 0's scontrol returns. The group's timeout bounds it.
            dist.barrier()

    def _count_samples(self, trainer: pl.Trainer) -> None:
        epoch = trainer.current_epoch
        if epoch != self._epoch_counted:
            resume, self._resume = self._resume, None
            self._epoch_counted = epoch
            self._samples = resume[1] if resume is not None and resume[0] == epoch else 0
        self._samples += samples_per_micro_step(trainer, "BackupAndRestore")

    def save(self, trainer: pl.Trainer) -> None:
        """Take a backup now (on every process at the same step, or on the chief alone under the parameter server)."""
        strategy = trainer.strategy
        if capabilities_of(strategy).saves_from_chief_alone and not trainer.is_global_zero:
            return  # the chief's backup holds the servers' state; the workers' own state is their data position
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        previous = strategy.checkpoint_io
        strategy.checkpoint_io = self._writer
        try:
            strategy.save_checkpoint(checkpoint, self._store.path_for(trainer.global_step))
        finally:
            strategy.checkpoint_io = previous
        self.backups_taken += 1
        self._last_time = time.monotonic()

    def _async_group(self, trainer: pl.Trainer, timeout: object) -> dist.ProcessGroup | None:
        """A gloo group of every rank for sharded asynchronous backups, whose collectives run beside training's.

        Created here, on every rank at the same point of setup (``new_group`` is collective over the default group),
        only when the strategy writes sharded backups from every rank.
        """
        sharded = getattr(trainer.strategy, "state_dict_type", "full") == "sharded"
        if not (sharded and self.async_save and _collective(trainer)):
            return None
        return dist.new_group(backend="gloo", timeout=timeout if isinstance(timeout, timedelta) else None)

    # --- end -------------------------------------------------------------------------------------------------------

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._active:
            try:
                self._writer.wait()  # the backup in flight is still worth having
            except Exception:  # the run's own exception is the one to report
                log.exception("BackupAndRestore: the last backup could not be written")
            received = self._watch.received
            if received is not None and isinstance(exception, Exception):
                # Told to stop, and the run failed before its backup: typically a peer whose grace ran out left the
                # collective this rank waits in. Exit as the grace timer would, so the job is requeued on exit_code.
                log.error(
                    "BackupAndRestore: the run failed after %s; exiting with code %d, the previous backup stands.",
                    received.name,
                    self.exit_code,
                    exc_info=exception,
                )
                os._exit(self.exit_code)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            # The last step's agreement, which every rank started, ends here: an async gloo work still held when the
            # interpreter exits can abort the process (SIGABRT; torch closed PR 179291). The run is complete, so a
            # signal raised in its last step needs no backup.
            self._agreement.collect(_FLAGS)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self._active:
            return
        self._agreement.reset()  # after an exception too: hold no work past the run
        try:
            self._writer.teardown()
        finally:
            group, self._writer.async_group = self._writer.async_group, None
            if group is not None:
                with contextlib.suppress(Exception):  # the default group may be gone already after a failure
                    dist.destroy_process_group(group)
        self._watch.uninstall()
        self._cursor.clear()
        if self._unposition is not None:
            self._unposition()
            self._unposition = None
        self._active = False

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"backups_taken": self.backups_taken}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.backups_taken = int(state_dict.get("backups_taken", 0))


def _gather(trainer: pl.Trainer, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``mine`` (only the chief's under the parameter server, whose workers save nothing)."""
    if not _collective(trainer):
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _collective(trainer: pl.Trainer) -> bool:
    """Whether the ranks agree on flags (not under the parameter server, whose workers act on their own)."""
    strategy = trainer.strategy
    return capabilities_of(strategy).agrees_over_default_group and dist.is_initialized() and trainer.world_size > 1


def _trains_from_ours(loader: object) -> bool:
    """Whether the training loader is our resumable one (or ds_mirrored's even-batches wrapper around it)."""
    inner = getattr(loader, "dataloader", None)
    return isinstance(loader, ResumableDataLoader) or isinstance(inner, ResumableDataLoader)
