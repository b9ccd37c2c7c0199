"""What every benchmark script shares: a clean environment for its launches, running one, and summarising repeats."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from ds_lightning.testing import processes
from ds_lightning.testing.processes import free_port

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "free_port", "package_state", "run_detached", "spread", "worker_env"]


def worker_env(threads: int = 1, rendezvous: bool = True) -> dict[str, str]:
    """A clean environment for one launch (see :func:`ds_lightning.testing.worker_env`), the repository importable."""
    return processes.worker_env(threads, rendezvous, pythonpath=[REPO], warnings="ignore")


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
