"""Start real training processes (``ds-train`` or a helper script) with one thread each and a free port."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_lightning.testing import processes
from ds_lightning.testing.processes import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"

__all__ = [
    "CONFIGS",
    "REPO",
    "Ranks",
    "Run",
    "WarmRanks",
    "check_budget",
    "ds_train",
    "example_config",
    "free_port",
    "quiet_trainer_args",
    "run_module",
    "run_ranks",
    "set_test_timeout",
    "warm_pool",
    "worker_env",
]

# The running test's pytest timeout in seconds (None: none), noted by tests/conftest.py when pytest-timeout arms it.
_test_timeout_s: float | None = None


def set_test_timeout(seconds: float | None) -> None:
    """Note the running test's pytest timeout (``None`` once it ends), for :func:`check_budget`."""
    global _test_timeout_s  # one value per running test, set by the conftest hook
    _test_timeout_s = seconds


def check_budget(timeout: float) -> None:
    """Fail when a run's time budget is not under the running test's pytest timeout.

    pytest-timeout counts from the test's setup, so a budget at or over it never applies: pytest stops the test
    first and the run's output is lost. The fix is a smaller budget or a larger ``@pytest.mark.timeout``.
    """
    if _test_timeout_s is not None and timeout >= _test_timeout_s:
        raise AssertionError(
            f"a run budget of timeout={timeout:g} s is not under this test's pytest timeout of {_test_timeout_s:g} s, "
            f"so it would never apply: lower the budget or raise the test's @pytest.mark.timeout above it"
        )


def example_config(name: str, devices: int | None = 2) -> list[str]:
    """``--config`` for ``examples/configs/<name>``, with what a CPU test relies on said on the command line.

    The example files say ``accelerator: auto`` and ``devices: auto``: every GPU of a GPU machine, one process on a
    CPU. A test pins ``cpu`` and the process count its assertions assume (the files' 2 until they said ``auto``), so it
    runs the same on a GPU machine. Arguments after these still override them (``--trainer.devices=1``).
    ``devices=None`` leaves the count to the file.
    """
    args = [f"--config={CONFIGS / name}", "--trainer.accelerator=cpu"]
    return args if devices is None else [*args, f"--trainer.devices={devices}"]


def worker_env(**extra: str) -> dict[str, str]:
    """A clean environment for one launch: 1 thread, a free rendezvous port, this repository importable."""
    return processes.worker_env(pythonpath=[REPO], **extra)


@dataclass
class Run:
    """What a launch did: ``returncode`` sums it up (rank 0's code, or the first other rank's failure when rank 0
    succeeded); ``returncodes`` holds every process's, one per rank (one entry for a single process)."""

    returncode: int
    output: str
    seconds: float
    returncodes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.returncodes:
            self.returncodes = [self.returncode]

    def assert_every_rank_exits(self, code: int) -> None:
        """Every rank exited with ``code``: one rank's code (rank 0's, say) says nothing of the others'."""
        assert self.returncodes == [code] * len(self.returncodes), (
            f"expected every rank to exit with {code}, got {self.returncodes}:\n{self.output[-6000:]}"
        )

    def json(self, path: Path) -> dict[str, Any]:
        assert path.exists(), f"{path} was not written; output:\n{self.output[-4000:]}"
        return json.loads(path.read_text())


def ds_train(
    args: list[str], timeout: float = 180, env: dict[str, str] | None = None, check: bool = True, ranks: int = 1
) -> Run:
    """Run ``ds-train`` (through ``python -m ds_lightning.cli``) and return its exit code and output.

    ``ranks > 1`` starts that many processes at once (:class:`Ranks`) instead of letting Lightning's launcher start
    them: for runs whose subject is the training, not the launch.
    """
    if ranks > 1:
        run = run_ranks("ds_lightning.cli", args, ranks, timeout, env)
    else:
        run = run_module("ds_lightning.cli", args, timeout, env)
    if check:
        assert run.returncode == 0, f"ds-train {' '.join(args)} failed ({run.returncode}):\n{run.output[-6000:]}"
    return run


def run_module(module: str, args: list[str], timeout: float = 180, env: dict[str, str] | None = None) -> Run:
    """Run ``python -m module args`` from the repository root (one thread, a free port) and return what it did."""
    check_budget(timeout)
    cmd = [sys.executable, "-m", module, *args]
    start = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=env or worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, time.monotonic() - start)


class Ranks:
    """``python -m module args`` started once per rank at the same time, as torchrun would (``LOCAL_RANK``...).

    Lightning's own launcher imports the script in the first process and only then starts the others, each importing
    torch and Lightning again: on 2 cores that doubles a launch's start-up. Helper runs whose subject is training, not
    the launcher, start every rank at once instead; the launcher keeps its own tests (``ds-train``, the demos).
    """

    def __init__(self, module: str, args: list[str], ranks: int, env: dict[str, str] | None = None) -> None:
        base = env or worker_env()
        self.start = time.monotonic()
        # Files, not pipes: a rank blocked on a full pipe while the other waits in a collective would hang both.
        self.logs = [tempfile.TemporaryFile("w+", errors="replace") for _ in range(ranks)]  # noqa: SIM115 (closed in wait)
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=REPO,
                env={**base, "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(ranks)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for rank, log in enumerate(self.logs)
        ]

    def poll(self) -> bool:
        """Whether every rank is still running."""
        return all(proc.poll() is None for proc in self.procs)

    def wait(self, timeout: float) -> Run:
        """Every rank's exit (``returncodes``); ``returncode`` is rank 0's, or the first other rank's failure.

        Ranks still running after ``timeout`` seconds from the start are killed (their code is then negative).
        """
        check_budget(timeout)
        deadline = self.start + timeout
        late = False
        try:
            for proc in self.procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            late = True  # killed below: the code (-9) and the output say what each rank had done
        finally:
            self.kill()
        outputs = []
        for log in self.logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        return _ranks_run([proc.returncode for proc in self.procs], outputs, late, timeout, self.start)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _ranks_run(codes: list[int], outputs: list[str], late: bool, timeout: float, start: float) -> Run:
    """One run of several ranks: rank 0's code, or the first other rank's failure when rank 0 succeeded."""
    code = codes[0] or next((c for c in codes if c), 0)
    text = "".join(
        f"--- rank {rank} (exit {c}) ---\n{out}" for rank, (c, out) in enumerate(zip(codes, outputs, strict=True))
    )
    if late:
        text += f"--- killed: still running after {timeout:.0f} s ---\n"
    return Run(code, text, time.monotonic() - start, list(codes))


def run_ranks(module: str, args: list[str], ranks: int, timeout: float = 180, env: dict[str, str] | None = None) -> Run:
    """Run ``python -m module args`` as ``ranks`` processes started together.

    Each rank is forked from this session's warm pool of that size (:func:`warm_pool`): fresh processes with their own
    pids, signals and exit codes, without paying the imports again. ``DS_LIGHTNING_TEST_COLD_RANKS=1`` starts them as
    new interpreters instead (:class:`Ranks`), to rule the pool out when a run behaves oddly.
    """
    check_budget(timeout)  # before anything starts: a budget that can never apply is the test's error
    if os.environ.get("DS_LIGHTNING_TEST_COLD_RANKS") == "1":
        return Ranks(module, args, ranks, env).wait(timeout)
    return warm_pool(ranks).run(module, args, timeout, env=env or worker_env())


_pools: dict[int, WarmRanks] = {}


def warm_pool(ranks: int) -> WarmRanks:
    """This session's :class:`WarmRanks` of ``ranks`` processes, started on first use and closed at exit.

    A pool whose processes died (a test killed one) is replaced by a fresh one.
    """
    pool = _pools.get(ranks)
    if pool is not None and not pool.alive():
        with contextlib.suppress(Exception):  # its processes are gone: closing only frees what is left
            pool.close()
        pool = None
    if pool is None:
        pool = _pools[ranks] = WarmRanks(ranks)
        atexit.register(pool.close)
    return pool


class WarmRanks:
    """``ranks`` processes that import Lightning once, then fork each run's rank (``tests/helpers/warm_start.py``).

    For a test that restarts one training many times: every run is still fresh processes (own pids, signals and exit
    codes, as :class:`Ranks` starts), without the imports that take most of a short run's launch. One run at a time,
    each on a fresh rendezvous port; use as a context manager.
    """

    def __init__(self, ranks: int, preload: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """``preload``: the modules to import once (default: torch, Lightning, ds_lightning)."""
        base = env or worker_env()
        self.size = ranks
        self._dir = tempfile.TemporaryDirectory()
        self._errors = [tempfile.TemporaryFile("w+", errors="replace") for _ in range(ranks)]  # noqa: SIM115 (close)
        self._answers: list[queue.Queue[dict[str, Any]]] = [queue.Queue() for _ in range(ranks)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.warm_start", *preload],
                cwd=REPO,
                env={**base, "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(ranks)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=error,
                text=True,
            )
            for rank, error in enumerate(self._errors)
        ]
        for proc, answers in zip(self.procs, self._answers, strict=True):
            threading.Thread(target=_read_answers, args=(proc.stdout, answers), daemon=True).start()
        self.runs = 0
        self.pids: list[int] = []
        self._exits: list[int | None] = []
        self._logs: list[Path] = []
        self.start = time.monotonic()

    def __enter__(self) -> WarmRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, module: str, args: list[str], timeout: float = 180, env: dict[str, str] | None = None) -> Run:
        """:meth:`launch` then :meth:`wait`."""
        self.launch(module, args, env=env)
        return self.wait(timeout)

    def alive(self) -> bool:
        """Whether every warm process is still there to fork the next run."""
        return all(proc.poll() is None for proc in self.procs)

    def launch(
        self, module: str, args: list[str], imports_timeout: float = 180, env: dict[str, str] | None = None
    ) -> None:
        """Start ``python -m module args`` on every rank; the first run waits up to ``imports_timeout`` for imports.

        ``env``: the run's whole environment (as :func:`worker_env` gives it); each rank's launch variables and, unless
        ``env`` names one, a fresh ``MASTER_PORT`` go on top. Without it, the pool's own environment with a fresh port.
        """
        assert all(code is not None for code in self._exits), "the previous run is still going: wait for it first"
        port = str(free_port())
        self._logs = [Path(self._dir.name) / f"run{self.runs}.rank{rank}.log" for rank in range(self.size)]
        for rank, (proc, log) in enumerate(zip(self.procs, self._logs, strict=True)):
            run: dict[str, Any] = {"module": module, "args": args, "env": {"MASTER_PORT": port}, "log": str(log)}
            if env is not None:
                ranked = {"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(self.size)}
                run["env"] = {"MASTER_PORT": port, **env, **ranked}
                run["replace_env"] = True
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(run) + "\n")
            proc.stdin.flush()
        self.runs += 1
        self.start = time.monotonic()
        self.pids = [self._next(rank, "pid", self.start + imports_timeout) for rank in range(self.size)]
        self.start = time.monotonic()  # the run starts once forked: the imports were paid before
        self._exits = [None] * self.size

    def poll(self) -> bool:
        """Whether every rank of the current run is still running."""
        for rank in range(self.size):
            if self._exits[rank] is None and not self._answers[rank].empty():
                self._exits[rank] = self._next(rank, "exit", time.monotonic() + 1)
        return all(code is None for code in self._exits)

    def wait(self, timeout: float) -> Run:
        """The run's exit as :meth:`Ranks.wait` gives it; ranks running ``timeout`` s after the start are killed."""
        check_budget(timeout)
        late = False
        try:
            for rank in range(self.size):
                if self._exits[rank] is None:
                    self._exits[rank] = self._next(rank, "exit", self.start + timeout)
        except TimeoutError:
            late = True  # killed below: the code (-9) and the output say what each rank had done
        finally:
            self.kill()
        outputs = [log.read_text(errors="replace") if log.exists() else "" for log in self._logs]
        codes = [code if code is not None else -signal.SIGKILL for code in self._exits]
        return _ranks_run(codes, outputs, late, timeout, self.start)

    def kill(self) -> None:
        """SIGKILL the current run's ranks that still run, and wait (30 s at most) for their exits."""
        for rank, pid in enumerate(self.pids):
            if self._exits[rank] is None:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: its exit is on the way
                    os.kill(pid, signal.SIGKILL)
        for rank in range(len(self.pids)):
            if self._exits[rank] is None:
                self._exits[rank] = self._next(rank, "exit", time.monotonic() + 30)

    def close(self) -> None:
        """End the current run (killed) and the warm processes."""
        try:
            if self.pids:
                self.kill()
        finally:
            for proc in self.procs:
                if proc.stdin is not None:
                    proc.stdin.close()  # the end of its runs: it exits
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for error in self._errors:
                error.close()
            self._dir.cleanup()

    def _next(self, rank: int, key: str, deadline: float) -> int:
        try:
            answer = self._answers[rank].get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            raise TimeoutError(f"warm rank {rank}: no {key!r} by the deadline") from None
        if key not in answer:
            self._errors[rank].seek(0)
            error = self._errors[rank].read()[-4000:]
            raise AssertionError(f"warm rank {rank} answered {answer} for {key!r}:\n{error}")
        return int(answer[key])


def _read_answers(stream: Any, answers: queue.Queue[dict[str, Any]]) -> None:
    for line in stream:
        answers.put(json.loads(line))
    answers.put({"closed": True})


def quiet_trainer_args(root: Path) -> list[str]:
    return [
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
    ]
