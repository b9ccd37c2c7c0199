"""What every benchmark script shares: a clean environment for its launches, running one, and summarising repeats."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(threads: int = 1, rendezvous: bool = True) -> dict[str, str]:
    """This environment without any launcher's or cluster's variables, ``threads`` threads, the repo importable.

    With ``rendezvous`` it also names 127.0.0.1 and a free port for a multi-process launch.
    """
    env = dict(os.environ)
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GROUP_RANK", "RANK", "TF_CONFIG", "PL_GLOBAL_SEED"):
        env.pop(var, None)
    for var in ("DS_PS_SERVER", "DS_PS_SERVERS_STARTED"):
        env.pop(var, None)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])),
        PYTHONWARNINGS="ignore",
    )
    if rendezvous:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return env


def run_detached(
    worker: Path, spec_path: Path, cwd: str | Path, log_path: Path, timeout: float, env: dict[str, str]
) -> Any:
    """Run ``python worker spec_path`` in a session of its own, output to ``log_path``; its exit code or "timeout".

    Whatever the launch left running (ranks, servers) is killed afterwards: exactly its own process group.
    """
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(worker), str(spec_path)],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc: Any = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc


def spread(values: list[float]) -> dict[str, Any] | None:
    """Median, min, max and every value, or ``None`` for no values."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def package_state() -> dict[str, Any]:
    """The commit measured, and whether the package had uncommitted changes (results describe the working tree)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted": git("status", "--short", "--", "ds_lightning").splitlines(),
    }
