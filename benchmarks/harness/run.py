"""Running an experiment: one fresh worker process per run, in interleaved order, each run read into one record."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_lightning.testing import processes

from .spec import Arm, Experiment

REPO = Path(__file__).resolve().parents[2]


class Failed(RuntimeError):
    """A run that produced no result; its message becomes the record's ``"error"``, ``found`` is whatever the launch
    did write (for a benchmark that keeps partial results), ``log`` its output."""

    def __init__(self, message: str, found: dict[str, Any] | None = None, log: str = "") -> None:
        super().__init__(message)
        self.found = found or {}
        self.log = log


def _read(path: Path) -> Any:
    """A JSON file, or a JSON-lines file as a list (a line cut short by a kill is left out)."""
    if path.suffix != ".jsonl":
        return json.loads(path.read_text())
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def worker_env(threads: int = 1, rendezvous: bool = True, **extra: str) -> dict[str, str]:
    """A clean environment for one launch (:func:`ds_lightning.testing.worker_env`), the repository importable."""
    return processes.worker_env(threads, rendezvous, pythonpath=[REPO], warnings="ignore", **extra)


def error_line(log: str) -> str:
    """The last line of a log that names an error, cut short; empty when there is none."""
    lines = [line.strip() for line in log.splitlines() if "Error" in line or "error" in line]
    return lines[-1][:300] if lines else ""


def launch(
    worker: Path | str,
    spec: dict[str, Any],
    timeout: float,
    env: dict[str, str] | None = None,
    outputs: str = "result*.json",
) -> tuple[dict[str, Any], float, str]:
    """Run ``python worker spec.json`` in a session of its own (its process group killed afterwards); the spec gains
    ``"out_dir"``, where the worker writes ``outputs``. Returns ``({file stem: parsed JSON, "rc": exit code or
    "timeout"}, seconds, log)``; raises :class:`Failed` when the worker wrote nothing or timed out."""
    with tempfile.TemporaryDirectory(prefix="ds-bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps({**spec, "out_dir": tmp}))
        log_path = Path(tmp) / "log.txt"
        start = time.monotonic()
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, str(worker), str(spec_path)],
                cwd=tmp,
                env=env if env is not None else worker_env(rendezvous=False),
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
        seconds = time.monotonic() - start
        text = log_path.read_text(errors="replace")
        found = {p.stem: _read(p) for p in sorted(Path(tmp).glob(outputs))}
    if not found or rc == "timeout":
        reason = f"timed out after {timeout:.0f} s" if rc == "timeout" else f"exit code {rc}"
        line = error_line(text)
        raise Failed(f"{reason}, {line}" if line else reason, {"rc": rc, **found}, text)
    return {"rc": rc, **found}, seconds, text


def run_experiment(
    experiment: Experiment,
    run: Callable[[Arm, int], dict[str, Any]],
    progress: Callable[[dict[str, Any]], str] | None = None,
) -> list[dict[str, Any]]:
    """Run every arm ``repeats`` times in :meth:`Experiment.order`: one record ``{"arm", "repeat", "order",
    "seconds", **reading}`` per run, with ``"error"`` where ``run`` raised (the next run starts)."""
    records = []
    for i, (rep, arm) in enumerate(experiment.order()):
        start = time.monotonic()
        head = f"  repeat {rep + 1}/{experiment.repeats} {arm.name:>12}:"
        try:
            reading = run(arm, rep)
        except Exception as exc:  # a failed run is a result; the benchmark goes on
            reading = {"error": f"{type(exc).__name__}: {exc}" if not isinstance(exc, Failed) else str(exc)}
        record = {"arm": arm.name, "repeat": rep, "order": i, "seconds": time.monotonic() - start, **reading}
        records.append(record)
        if "error" in record:
            print(f"{head} FAILED {record['error']}", flush=True)
        else:
            print(f"{head} {progress(record) if progress else 'done'} ({record['seconds']:.0f} s)", flush=True)
    return records


#: the code a benchmark run measures, as git pathspecs: the package and the benchmarks, but not what they write
MEASURED = ("ds_lightning", "benchmarks", ":(exclude)benchmarks/results", ":(exclude)*.md")


def package_state() -> dict[str, Any]:
    """The commit measured, and whether the package had uncommitted changes (results describe the working tree)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted": git("status", "--short", "--", *MEASURED).splitlines(),
    }
