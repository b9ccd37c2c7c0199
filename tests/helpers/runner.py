"""Start real training processes (``ds-train`` or a helper script) with one thread each and a free port."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_lightning.testing import processes
from ds_lightning.testing.processes import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"

__all__ = ["CONFIGS", "REPO", "Run", "ds_train", "free_port", "quiet_trainer_args", "run_module", "worker_env"]


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


def quiet_trainer_args(root: Path) -> list[str]:
    return [
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
    ]
