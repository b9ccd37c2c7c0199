"""Notice a collective that waits too long, and gather every rank's view of it before the backend gives up.

One thread per rank polls torch's Flight Recorder (a snapshot of the calls still waiting costs well under a
millisecond). When a call has waited ``timeout - margin``, the rank raises an alarm in the rendezvous store. Every
rank's thread watches for alarms, and each answers once with its view (what it waits in, the last call it issued on
each group, where its main thread is: a rank busy in ``training_step`` answers too, from this thread) and its
Flight Recorder dump. The store is used because the process group itself is unusable once a gloo call timed out;
the thread has its own short-timeout connection to it, so a cut link makes it give up, not hang.

When the backend then raises (at ``timeout``), the strategy's ``on_exception`` calls :meth:`HangWatch.diagnose`:
it collects the views (at most :data:`VIEW_WAIT_S`), writes every rank's dump and the verdict to the dump folder,
and returns the verdict, whose message is added to the backend's error.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ds_lightning.diagnostics.flight_recorder import fix_pg_config, pg_table, recorder_size, snapshot, write_dump
from ds_lightning.diagnostics.hang_verdict import Call, HangVerdict, RankView, judge, place_of, stack_of_thread

__all__ = ["COLLECTIVE_FAILURE", "DISABLE_VARIABLE", "FOLDER_VARIABLE", "VIEW_WAIT_S", "HangWatch", "watch_strategy"]

log = logging.getLogger(__name__)

#: Errors gloo and NCCL raise when a collective could not finish.
COLLECTIVE_FAILURE = re.compile(
    r"timed? ?out|timeout|pair closure|connection closed|connection reset|broken pipe", re.IGNORECASE
)
#: The longest the failing rank waits for the other ranks' views after its error.
VIEW_WAIT_S = 8.0
STORE_TIMEOUT_S = 5.0
#: ``DS_LIGHTNING_HANG_DIAGNOSIS=0`` switches the watch off; ``DS_LIGHTNING_HANG_DIR`` chooses the dump folder.
DISABLE_VARIABLE = "DS_LIGHTNING_HANG_DIAGNOSIS"
FOLDER_VARIABLE = "DS_LIGHTNING_HANG_DIR"
POLL_S = 0.5


def _margin(timeout_s: float) -> float:
    """How long before the backend's timeout the alarm goes up: time for every rank to answer."""
    return min(10.0, max(2.0, 0.2 * timeout_s))


class HangWatch:
    """Watch this rank's collectives; answer other ranks' alarms (see the module's docs).

    Args:
        rank: this process's global rank.
        timeout_s: the process group's timeout.
        store_address: the rendezvous store's host and port.
        dump_folder: where dumps and the verdict go, asked for when they are written (the run's folder).
        prefix: the store keys' prefix, unique to this group of processes (torchrun's restarts share a store).

    """

    def __init__(
        self,
        rank: int,
        timeout_s: float,
        store_address: tuple[str, int],
        dump_folder: Callable[[], Path],
        prefix: str = "ds_lightning/hang/0/",
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.trigger_s = max(0.5, timeout_s - _margin(timeout_s))
        self.store_address = store_address
        self.dump_folder = dump_folder
        self.prefix = prefix
        self.alarm: Call | None = None
        self.view: RankView | None = None
        self._main = threading.main_thread().ident
        self._store: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds-hang-watch", daemon=True)

    # --- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> bool:
        """Start watching; False (with the reason logged) when the Flight Recorder is off or the store unreachable."""
        if recorder_size() == 0:
            log.info("ds_lightning: TORCH_FR_BUFFER_SIZE=0 switches torch's Flight Recorder off: no hang diagnosis")
            return False
        try:
            host, port = self.store_address
            client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
            self._store = dist.PrefixStore(self.prefix, client)
        except Exception as error:  # the run goes on; only the diagnosis is lost
            log.warning("ds_lightning: no hang diagnosis, the rendezvous store did not answer: %s", error)
            return False
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop the thread (at teardown)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._tick()
            except Exception as error:  # a store that went away (link cut): keep watching the recorder
                log.debug("ds_lightning hang watch: %s", error)

    def _tick(self) -> None:
        now = time.time_ns()
        waiting = [e for e in snapshot(only_active=True)["entries"] if not e.get("retired", False)]
        overdue = [e for e in waiting if now - int(e["time_created_ns"]) >= self.trigger_s * 1e9]
        if overdue and self.alarm is None:
            self.raise_alarm(self._with_stack(overdue[0]))
        if self.view is None and int(self._store.add("alarms", 0)) > 0:
            self.answer()

    # --- the protocol ---------------------------------------------------------------------------------------------

    def _with_stack(self, entry: dict[str, Any]) -> Call:
        """``entry`` as a call, with the stack it was made from (a snapshot with stacks, matched by record id)."""
        now = time.time_ns()
        for full in snapshot(stacks=True, only_active=True)["entries"]:
            if full.get("record_id") == entry.get("record_id"):
                return Call.from_entry(full, now)
        return Call.from_entry(entry, now)

    def raise_alarm(self, call: Call) -> None:
        """Tell every rank that ``call`` waits too long here."""
        self.alarm = call
        self._store.set(f"alarm/{self.rank}", json.dumps(call.__dict__))
        self._store.add("alarms", 1)

    def answer(self) -> RankView:
        """Post this rank's view and Flight Recorder dump (once), and write the dump to the dump folder."""
        view, dump = self._own_view()
        self._post(self._store, view, dump)
        return view

    def _own_view(self) -> tuple[RankView, bytes]:
        """This rank's view and its dump (pickled, ``pg_config`` fixed); the dump is written locally too."""
        full = snapshot(stacks=True)
        now = time.time_ns()
        last: dict[str, int] = {}
        for entry in full["entries"]:
            group = str(entry["process_group"][0])
            last[group] = max(last.get(group, 0), int(entry["collective_seq_id"]))
        waiting = [Call.from_entry(e, now) for e in full["entries"] if not e.get("retired", False)]
        if self.alarm is not None and not waiting:
            waiting = [self.alarm]  # the backend gave up on it already: it is still what this rank waited in
        where = place_of(stack_of_thread(self._main))
        self.view = RankView(self.rank, socket.gethostname(), waiting, last, where)
        table = pg_table()
        try:
            write_dump(self.dump_folder(), self.rank, full, table)
        except OSError as error:
            log.warning("ds_lightning: could not write the Flight Recorder dump: %s", error)
        return self.view, pickle.dumps(fix_pg_config(full, table))

    def _post(self, store: Any, view: RankView, dump: bytes) -> None:
        store.set(f"view/{self.rank}", json.dumps(view.to_json()))
        store.set(f"dump/{self.rank}", dump)

    def _client(self) -> Any:
        host, port = self.store_address
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
        return dist.PrefixStore(self.prefix, client)

    def diagnose(self, exception: BaseException, ranks: Sequence[int]) -> HangVerdict | None:
        """After the backend's error: the verdict on the call this rank waited in.

        ``None`` when the error is not a collective's failure, or nothing was recorded. Writes every rank's dump it can
        get, and ``verdict_rank<r>.json``, to the dump folder. Talking to the store happens in a thread of its own,
        on a connection of its own, given at most :data:`VIEW_WAIT_S` plus two store timeouts: a store behind a cut
        link can leave a call on an open connection waiting for ever (the watch thread's, too).
        """
        if self._store is None or not COLLECTIVE_FAILURE.search(str(exception)):
            return None
        alarm_now = self.alarm is None
        if alarm_now:  # it failed before the alarm (a peer's connection closed): the newest call is it
            entries = snapshot(stacks=True)["entries"]
            if not entries:
                return None
            self.alarm = Call.from_entry(max(entries, key=lambda e: int(e["time_created_ns"])), time.time_ns())
        stuck = self.alarm
        assert stuck is not None
        group = pg_table().get(stuck.group)
        if group is not None:  # the stuck call's own group, in global ranks
            ranks = json.loads(group["ranks"]) or list(ranks)
        posted = self.view is not None
        view, dump = (self.view, b"") if self.view is not None else self._own_view()
        views: dict[int, RankView | None] = {self.rank: view}
        folder = self.dump_folder()

        def exchange() -> None:
            store = self._client()
            if alarm_now:
                store.set(f"alarm/{self.rank}", json.dumps(stuck.__dict__))
                store.add("alarms", 1)
            if not posted:
                self._post(store, view, dump)
            self._collect(store, ranks, views)
            self._fetch_dumps(store, folder, ranks)

        thread = threading.Thread(target=self._quietly, args=(exchange,), name="ds-hang-verdict", daemon=True)
        thread.start()
        thread.join(VIEW_WAIT_S + 2 * STORE_TIMEOUT_S)
        verdict = judge(stuck, self.timeout_s, ranks, dict(views))
        verdict.dump_dir = str(folder)
        verdict.after_s = (time.time_ns() - stuck.created_ns) / 1e9 if stuck.created_ns else None
        self._write(folder, verdict)
        return verdict

    @staticmethod
    def _quietly(work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as error:  # the store is gone: the verdict uses what arrived
            log.debug("ds_lightning hang verdict: %s", error)

    def lost_peer(self, peer: int, name: str) -> HangVerdict | None:
        """The verdict when a peer outside the watched group stopped answering (a parameter server, to a worker).

        The stuck call is this rank's newest (its send to or receive from the peer); the peer cannot answer, so there
        is nothing to collect. Writes this rank's dump and the verdict.
        """
        full = snapshot(stacks=True)
        if not full["entries"]:
            return None
        newest = max(full["entries"], key=lambda e: int(e["time_created_ns"]))
        stuck = Call.from_entry(newest, time.time_ns())
        verdict = HangVerdict(stuck, self.timeout_s, arrived=[self.rank], silent=[peer], names={peer: name})
        folder = self.dump_folder()
        verdict.dump_dir = str(folder)
        verdict.after_s = (time.time_ns() - stuck.created_ns) / 1e9
        try:
            write_dump(folder, self.rank, full)
        except OSError as error:
            log.warning("ds_lightning: could not write the Flight Recorder dump: %s", error)
        self._write(folder, verdict)
        return verdict

    def _collect(self, store: Any, ranks: Sequence[int], views: dict[int, RankView | None]) -> None:
        """Fill ``views`` with the other ranks' views as they arrive, for at most :data:`VIEW_WAIT_S`."""
        deadline = time.monotonic() + VIEW_WAIT_S
        while time.monotonic() < deadline and any(rank not in views for rank in ranks):
            for rank in ranks:
                if rank not in views and store.check([f"view/{rank}"]):
                    views[rank] = RankView.from_json(json.loads(store.get(f"view/{rank}")))
            time.sleep(0.2)

    def _fetch_dumps(self, store: Any, folder: Path, ranks: Sequence[int]) -> None:
        """Write the other ranks' posted dumps beside this rank's: one folder for ``ds-train diagnose``."""
        for rank in ranks:
            if rank != self.rank and store.check([f"dump/{rank}"]):
                write_dump(folder, rank, pickle.loads(store.get(f"dump/{rank}")))

    def _write(self, folder: Path, verdict: HangVerdict) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"verdict_rank{self.rank}.json").write_text(json.dumps(verdict.to_json(), indent=2))
        except OSError as error:
            log.warning("ds_lightning: could not write the hang verdict: %s", error)


def watch_strategy(strategy: Any, prefix: str) -> HangWatch | None:
    """Start watching a multi-process strategy's collectives once its process group is up.

    ``None`` for one process, with ``DS_LIGHTNING_HANG_DIAGNOSIS=0``, or when the watch cannot start.
    """
    if os.environ.get(DISABLE_VARIABLE, "1").strip() == "0" or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    env = strategy.cluster_environment
    timeout = strategy._timeout.total_seconds() if strategy._timeout is not None else 1800.0

    def folder() -> Path:
        chosen = os.environ.get(FOLDER_VARIABLE)
        if chosen:
            return Path(chosen)
        module = strategy.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return Path(trainer.default_root_dir if trainer is not None else os.getcwd()) / "flight_recorder"

    watch = HangWatch(dist.get_rank(), timeout, (env.main_address, env.main_port), folder, prefix)
    return watch if watch.start() else None
