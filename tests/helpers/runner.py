"""Start real training processes (``ds-train`` or a helper script) with one thread each and a free port."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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
    "ds_train",
    "free_port",
    "quiet_trainer_args",
    "run_module",
    "run_ranks",
    "worker_env",
]


def worker_env(**extra: str) -> dict[str, str]:
    """A clean environment for one launch: 1 thread, a free rendezvous port, this repository importable."""
    return processes.worker_env(pythonpath=[REPO], **extra)


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float

    def json(self, path: Path) -> dict[str, Any]:
        assert path.exists(), f"{path} was not written; output:\n{self.output[-4000:]}"
        return json.loads(path.read_text())


def ds_train(args: list[str], timeout: float = 180, env: dict[str, str] | None = None, check: bool = True) -> Run:
    """Run ``ds-train`` (through ``python -m ds_lightning.cli``) and return its exit code and output."""
    run = run_module("ds_lightning.cli", args, timeout, env)
    if check:
        assert run.returncode == 0, f"ds-train {' '.join(args)} failed ({run.returncode}):\n{run.output[-6000:]}"
    return run


def run_module(module: str, args: list[str], timeout: float = 180, env: dict[str, str] | None = None) -> Run:
    """Run ``python -m module args`` from the repository root (one thread, a free port) and return what it did."""
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
        """Every rank's exit; the code is rank 0's, or the first other rank's failure when rank 0 succeeded.

        Ranks still running after ``timeout`` seconds from the start are killed (their code is then negative).
        """
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
        codes = [proc.returncode for proc in self.procs]
        code = codes[0] or next((c for c in codes if c), 0)
        text = "".join(
            f"--- rank {rank} (exit {c}) ---\n{out}" for rank, (c, out) in enumerate(zip(codes, outputs, strict=True))
        )
        if late:
            text += f"--- killed: still running after {timeout:.0f} s ---\n"
        return Run(code, text, time.monotonic() - self.start)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_ranks(module: str, args: list[str], ranks: int, timeout: float = 180, env: dict[str, str] | None = None) -> Run:
    """Run ``python -m module args`` as ``ranks`` processes started together (see :class:`Ranks`)."""
    return Ranks(module, args, ranks, env).wait(timeout)


def quiet_trainer_args(root: Path) -> list[str]:
    return [
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
    ]
