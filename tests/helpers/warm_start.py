"""One rank that imports once and forks a fresh process per run: ``python -m tests.helpers.warm_start [MODULE...]``.

It imports the modules named (Lightning and ds_lightning by default), then reads runs from stdin, one JSON line each:
``{"module": ..., "args": [...], "env": {...}, "log": path}`` (with ``"replace_env": true``, ``env`` is the run's
whole environment, not additions). For each it forks a child that runs
``python -m module args`` as a new interpreter would: its own pid, signals and exit code, output in ``log``. It
answers ``{"pid": child}`` once the child is started and ``{"exit": code}`` once it ended (negative: killed by that
signal), then reads the next run; at the end of stdin it exits.

Why: importing Lightning costs a launch about 8 s of CPU, far more than a short run; a test that restarts one
training many times (preemption, crashes) pays it once. This process only imports: it trains nothing, starts no
thread and joins no process group, so every child starts as clean as a fresh launch (what ``ddp_fork`` relies on).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import sys
import threading
from typing import Any

PRELOAD = ("torch", "lightning.pytorch", "ds_lightning")


def _answer(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()  # nothing left buffered for a child to write again


def serve() -> dict[str, Any] | None:
    """Fork a child per run and wait for it; return the run in the child, ``None`` in this process at the end."""
    while line := sys.stdin.readline():
        run = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return run
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"exit": os.waitstatus_to_exitcode(status)})
    return None


def run_as_main(run: dict[str, Any]) -> None:
    """In the child: the run's output to its log, its environment, then ``module`` as ``__main__``."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    log = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    env = run.get("env", {})
    if run.get("replace_env"):
        # The run's whole environment, as a new interpreter would start with it. What the interpreter reads only at
        # start-up is applied by hand: PYTHONPATH's folders and the thread count torch took when it was imported.
        os.environ.clear()
        for folder in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
            if folder and folder not in sys.path:
                sys.path.insert(0, folder)
        if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.environ.update(env)
    sys.argv = [run["module"], *run["args"]]
    # Returns or raises as the module does: the interpreter then exits as it would after `python -m module`.
    runpy.run_module(run["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    for name in sys.argv[1:] or PRELOAD:
        importlib.import_module(name)
    # A fork copies only the forking thread: a lock another thread held would stay locked in every child.
    assert threading.active_count() == 1, f"importing started threads: {threading.enumerate()}"
    # The imported objects move out of the collector's reach: a child's collections and its exit then leave their
    # pages shared instead of copying them (a child's exit took 1.8 s with them, 0.5 s without, on 2 cores).
    gc.freeze()
    child_run = serve()
    if child_run is not None:
        run_as_main(child_run)
