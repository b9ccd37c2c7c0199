"""The parameter server's loop: apply pushed gradients to its shard, answer pulls under the staleness rule.

One thread per worker blocks in gloo ``recv`` from that worker and handles each whole message under one lock, so the
shard, clocks and optimizer see one message at a time; the main thread only waits for the end or a timeout. A
per-worker receive (rather than ``recv_anysource``) is what makes a dead worker visible: gloo fails a receive from a
peer whose connection closed, while an any-source receive keeps waiting.

Requests (``op`` in the header), all from worker ``w``:

* ``init`` (chief only, first): the parameters, optimizer and scheduler state and progress to start from.
* ``pull``: answer with this shard once the staleness rule lets ``w`` start its next step.
* ``peek``: answer at once (evaluation reads the latest parameters).
* ``push``: a gradient computed on parameters of version ``basis``; with ``then_pull`` it also asks for the next
  pull, answered like ``pull``, so the answer is on its way while the worker finishes its step.
* ``state``: everything a checkpoint needs.
* ``save`` (chief only): write this server's part of a sharded checkpoint into ``path`` with the other servers
  (:mod:`~ds_lightning.parameter_server.server_checkpoint`), then answer with the progress ``meta.pt`` records.
* ``status``: which workers are alive.
* ``done``: ``w`` finished; answer with the final shard once every worker finished or was lost, so each worker ends
  ``fit`` holding the same final parameters (with ``with_state``, also what ``state`` answers: the chief's last
  checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException

from ds_lightning.parameter_server.checkpoint import ServingProgress, ShardState, hyperparameters, jsonable
from ds_lightning.parameter_server.optimizer_shard import ShardOptimizer
from ds_lightning.parameter_server.push_compression import PushCompressor
from ds_lightning.parameter_server.server_checkpoint import write_server_part
from ds_lightning.parameter_server.staleness import StalenessClock, StalenessStats, SyncAccumulator, staleness_lr_factor
from ds_lightning.parameter_server.tensor_messages import Pending, channel_capacity, post_message, recv_message

log = logging.getLogger(__name__)

REQUEST_TAG = 11
REPLY_TAG = 12


@dataclass
class SchedulerSlot:
    """One LR scheduler the server steps, with Lightning's ``interval`` and ``frequency``."""

    scheduler: Any
    interval: str
    frequency: int


@dataclass
class ServeReport:
    """What a server did, for its log line and the tests."""

    updates: int = 0
    finished: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    seconds: float = 0.0


class ParameterServer:
    """Serve one shard until every worker has finished or been lost.

    Args:
        pg: the gloo group of workers (ranks ``0..num_workers-1``) and servers (after them).
        server: this server's index; its rank is ``num_workers + server``.
        num_workers: the number of workers.
        shard: the shard and its optimizer.
        schedulers: the user's LR schedulers, bound to ``shard.template``.
        max_staleness: ``None``, ``0`` or ``k``.
        staleness_lr: ``"none"`` or ``"inverse"``.
        max_updates: stop the workers after this many applied updates (``None``: never).
        timeout: seconds without any message before the server gives up.
        fail_on_lost_worker: raise when a worker is lost instead of serving the others on (under torchrun, which
            restarts the whole group anyway: the survivors must not train on without it before that).

    """

    def __init__(
        self,
        pg: Any,
        server: int,
        num_workers: int,
        shard: ShardOptimizer,
        schedulers: list[SchedulerSlot],
        max_staleness: int | None,
        staleness_lr: str,
        max_updates: int | None,
        timeout: float,
        fail_on_lost_worker: bool = False,
    ) -> None:
        self.pg = pg
        self.fail_on_lost_worker = fail_on_lost_worker
        self.server = server
        self.num_workers = num_workers
        self.shard = shard
        self.schedulers = schedulers
        self.max_staleness = max_staleness
        self.staleness_lr = staleness_lr
        self.max_updates = max_updates
        self.timeout = timeout
        self.clock = StalenessClock(num_workers, max_staleness)
        self.sync = SyncAccumulator(num_workers) if max_staleness == 0 else None
        self.version = 0
        self.updates = 0
        self.epochs_done = 0
        self.stats = StalenessStats()
        self.window = [StalenessStats() for _ in range(num_workers)]
        self.worker_progress: list[list[int]] = [[0, 0] for _ in range(num_workers)]  # [global_step, epoch]
        self.initialized = False
        self._base_clock = 0  # version at init: clocks count this run's pushes, versions the checkpoint's too
        self.deferred: list[tuple[int, dict[str, Any]]] = []
        self.early: list[tuple[int, dict[str, Any], list[Tensor]]] = []
        self.changed = threading.Condition()
        self.outbox = [Pending([], []) for _ in range(num_workers)]
        self.capacity = channel_capacity(shard.flat.numel() * shard.flat.element_size())  # one fp32 shard per transfer
        self.failure: BaseException | None = None
        self.last_heard = time.monotonic()
        self.report = ServeReport()

    # --- receiving ------------------------------------------------------------------------------------------------

    def _receive_from(self, worker: int) -> None:
        buffer = torch.empty(self.capacity, dtype=torch.uint8)
        while True:
            try:
                header, tensors, _ = recv_message(self.pg, worker, REQUEST_TAG, self.capacity, buffer)
            except Exception as error:
                first = str(error).split(". This is typically")[0].splitlines()[0][:300]
                header, tensors = {"op": "lost", "error": first}, []
            # Handled on this thread, under the lock: no hand-over to another thread on the hot path.
            with self.changed:
                try:
                    self._dispatch(worker, header, tensors)
                except BaseException as error:
                    self.failure = error
                self.last_heard = time.monotonic()
                leaving = header.get("op") in ("done", "lost") or self.failure is not None
                if leaving:
                    self.changed.notify_all()  # only the end of a worker concerns the main thread
            if leaving:
                return

    def _dispatch(self, worker: int, header: dict[str, Any], tensors: list[Tensor]) -> None:
        if not self.initialized and header.get("op") not in ("init", "lost"):
            self.early.append((worker, header, tensors))
            return
        self._handle(worker, header, tensors)
        if header.get("op") == "init":
            for item in self.early:
                self._handle(*item)
            self.early.clear()
        self._answer_deferred()

    def _running(self) -> list[int]:
        return [w for w in range(self.num_workers) if w not in self.report.finished + self.report.lost]

    def serve(self) -> ServeReport:
        """Run until every worker finished or was lost.

        Raises:
            TimeoutError: when no worker sends anything for ``timeout`` seconds while some are still running.

        """
        start = time.monotonic()
        self.last_heard = start
        for worker in range(self.num_workers):
            threading.Thread(target=self._receive_from, args=(worker,), daemon=True, name=f"ps-recv-{worker}").start()
        with self.changed:
            while self._running():
                if self.failure is not None:
                    raise self.failure
                left = self.timeout - (time.monotonic() - self.last_heard)
                if left <= 0:
                    raise TimeoutError(
                        f"parameter server {self.server} heard nothing from workers {self._running()} for"
                        f" {self.timeout:.0f} s; they are hung or unreachable. Raise the strategy's `timeout` if a"
                        " step can take that long."
                    )
                self.changed.wait(timeout=left)
        for pending in self.outbox:  # the last answers must reach the workers before this process exits
            with contextlib.suppress(Exception):  # a lost worker's answer fails; that is already reported
                pending.wait()
        self.report.updates = self.updates
        self.report.seconds = time.monotonic() - start
        return self.report

    # --- handling -------------------------------------------------------------------------------------------------

    def _handle(self, worker: int, header: dict[str, Any], tensors: list[Tensor]) -> None:
        op = header.get("op")
        if op == "init":
            self._init(header, tensors)
        elif op == "push":
            self._push(worker, header, tensors)
            if header.get("then_pull") and worker not in self.report.lost:
                self.deferred.append((worker, {"op": "pull", "step": header.get("step"), "epoch": header.get("epoch")}))
        elif op in ("pull", "done"):
            if op == "done":
                self.worker_progress[worker] = [int(header.get("step", 0)), int(header.get("epoch", 0))]
                self._retire(worker, finished=True)
            self.deferred.append((worker, header))
        elif op == "peek":
            self._reply(worker, header)
        elif op == "state":
            self._send_state(worker)
        elif op == "save":
            self._save_part(worker, header, tensors)
        elif op == "status":
            self._reply(worker, header, with_params=False)
        elif op == "lost":
            log.warning("parameter server %d lost worker %d: %s", self.server, worker, header.get("error"))
            if self.fail_on_lost_worker:
                raise RuntimeError(
                    f"parameter server {self.server} lost worker {worker} ({header.get('error')}); under torchrun the"
                    " whole group restarts and resumes from BackupAndRestore, so this server stops serving now."
                )
            self._retire(worker, finished=False)
        else:
            raise ValueError(f"parameter server {self.server} got unknown op {op!r} from worker {worker}")

    def _init(self, header: dict[str, Any], tensors: list[Tensor]) -> None:
        start = ShardState.from_message(header, tensors)
        self.shard.flat.copy_(start.flat)
        self.shard.import_state(start.entries, start.state)
        for group, hyper in zip(self.shard.template.param_groups, start.param_groups, strict=False):
            group.update({k: v for k, v in hyper.items() if k != "params"})
        for slot, state in zip(self.schedulers, start.schedulers, strict=False):
            slot.scheduler.load_state_dict(state)
        self.shard.sync_hyperparameters()
        self.version = self.updates = start.progress.updates
        self.epochs_done = start.progress.epoch
        if self.sync is not None:
            self.sync = SyncAccumulator(self.num_workers, version=self.version)
            for worker in self.report.lost + self.report.finished:
                self.sync.mark_dead(worker)
        self._base_clock = self.version
        self.initialized = True

    def _push(self, worker: int, header: dict[str, Any], tensors: list[Tensor]) -> None:
        grad = PushCompressor(header["compression"]).decode(tensors, self.shard.flat.numel())
        basis = int(header["basis"])
        self.worker_progress[worker] = [int(header.get("step", 0)), int(header.get("epoch", 0))]
        if worker == 0:
            self._advance_epochs(int(header.get("epoch", 0)))
        if worker in self.report.lost:
            return
        self.clock.tick(worker)
        if self.sync is not None:
            self.sync.push(worker, grad, basis)
            self.stats.record(0)
            self.window[worker].record(0)
            self._apply_sync_if_ready()
            return
        staleness = max(0, self.version - basis)
        self.stats.record(staleness)
        self.window[worker].record(staleness)
        self.shard.apply(grad, staleness_lr_factor(staleness, self.staleness_lr))  # type: ignore[arg-type]
        self._applied()

    def _apply_sync_if_ready(self) -> None:
        if self.sync is not None and self.sync.ready():
            self.shard.apply(self.sync.mean())
            self.sync.advance()
            self._applied()

    def _applied(self) -> None:
        self.version += 1
        self.updates += 1
        for slot in self.schedulers:
            if slot.interval == "step" and self.updates % slot.frequency == 0:
                slot.scheduler.step()

    def _advance_epochs(self, epoch: int) -> None:
        while self.epochs_done < epoch:
            self.epochs_done += 1
            for slot in self.schedulers:
                if slot.interval == "epoch" and self.epochs_done % slot.frequency == 0:
                    slot.scheduler.step()

    def _retire(self, worker: int, finished: bool) -> None:
        if worker in self.report.finished or worker in self.report.lost:
            return
        (self.report.finished if finished else self.report.lost).append(worker)
        if finished:
            self.clock.mark_finished(worker)
        else:
            self.clock.mark_dead(worker)
            self.deferred = [(w, h) for w, h in self.deferred if w != worker]
        if self.sync is not None:
            self.sync.mark_dead(worker)
            self._apply_sync_if_ready()

    # --- answering ------------------------------------------------------------------------------------------------

    def _may_answer(self, worker: int, header: dict[str, Any]) -> bool:
        if header.get("op") == "done":
            return not self._running()  # retired on arrival: the others' rules no longer wait for this worker
        if self.max_staleness is None:
            return True
        if self.max_staleness == 0:
            return self.version >= self._base_clock + self.clock.clocks[worker]
        return self.clock.may_start(worker)

    def _answer_deferred(self) -> None:
        waiting, self.deferred = self.deferred, []
        for worker, header in waiting:
            if self._may_answer(worker, header):
                self._reply(worker, header)
            else:
                self.deferred.append((worker, header))

    def _post(self, worker: int, answer: dict[str, Any], tensors: list[Tensor]) -> None:
        # Never block while holding the lock: a blocked send would stop this server's receiving threads, and a
        # worker waiting for one of them to take its push could then wait for us in turn (seen with 2 servers).
        # The worker has taken the previous answer before it asked again, so that wait returns at once.
        self.outbox[worker].wait()
        _, self.outbox[worker] = post_message(
            self.pg, worker, REPLY_TAG, answer, [t.clone() for t in tensors], self.capacity
        )

    def _reply(self, worker: int, header: dict[str, Any], with_params: bool = True) -> None:
        window = self.window[worker]
        answer = {
            "op": header.get("op"),
            "version": self.version,
            "updates": self.updates,
            "lost": list(self.report.lost),
            "gone": sorted(self.report.lost + self.report.finished),
            "stop": self.max_updates is not None and self.updates >= self.max_updates,
            "staleness_mean": window.mean,
            "staleness_max": window.max,
            "stats": self.stats.as_dict("ps/staleness"),
            "lrs": self.shard.learning_rates(),
            "clocks": list(self.clock.clocks),
        }
        self.window[worker] = StalenessStats()
        tensors = [self.shard.flat] if with_params else []
        if header.get("with_state"):
            fields, tensors = self._state().to_message()
            answer.update({k: v for k, v in fields.items() if k not in answer})
        try:
            self._post(worker, answer, tensors)
        except Exception as error:
            self._retire(worker, finished=False)
            log.warning("parameter server %d could not answer worker %d: %s", self.server, worker, error)

    def _save_part(self, worker: int, header: dict[str, Any], tensors: list[Tensor]) -> None:
        # Under the lock, as every request: serving pauses while this server writes (a consistent snapshot).
        first = self.server == 0  # writes the chief's part too: the module state no server holds, the param groups
        answer: dict[str, Any] = {"op": "save"}
        try:
            chief_model = dict(zip(header.get("chief_model", []), tensors, strict=True)) if first else {}
            groups = header.get("group_names") if first else None
            write_server_part(self.shard, self.shard.plan, Path(header["path"]), groups, chief_model)
        except (Exception, CheckpointException) as error:  # DCP's exception derives from BaseException only
            # Building a part happens in DCP's planning step and writing in its write step, whose errors DCP hands
            # to every server: all of them answer with an error, and the chief raises with this text.
            log.error("parameter server %d could not write its checkpoint part: %s", self.server, error)
            answer["error"] = f"{type(error).__name__}: {error}"[:2000]
        fields, _ = self._state(with_optimizer=False).to_message()
        self._post(worker, {**answer, **fields}, [])

    def _send_state(self, worker: int) -> None:
        answer, tensors = self._state().to_message()
        self._post(worker, {"op": "state", **answer}, tensors)

    def _state(self, with_optimizer: bool = True) -> ShardState:
        entries, state = self.shard.export_state() if with_optimizer else ([], [])
        return ShardState(
            flat=self.shard.flat,
            entries=entries,
            state=state,
            param_groups=hyperparameters(self.shard.template.param_groups),
            schedulers=[jsonable(slot.scheduler.state_dict()) for slot in self.schedulers],
            progress=ServingProgress(
                updates=self.updates,
                version=self.version,
                epoch=self.epochs_done,
                clocks=list(self.clock.clocks),
                worker_progress=[list(progress) for progress in self.worker_progress],
                lost=list(self.report.lost),
            ),
        )
