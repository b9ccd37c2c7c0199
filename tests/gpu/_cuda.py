"""Shared by the CUDA tests: launch a training from a spec, and its plain one-process CPU reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu._runs import run
from tests.helpers.runner import REPO, worker_env

BATCH = 16  # rows per replica and step
STEPS = 16


def needs_gpus(count: int) -> None:
    """Skip, saying so, where fewer than ``count`` CUDA devices are visible; also under ``make test-gpu``, where one GPU
    runs every other test."""
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA devices, this machine shows {torch.cuda.device_count()}")


def gpus(at_most: int = 2) -> int:
    """CUDA devices to use: two processes where two GPUs are visible, else one."""
    return max(1, min(at_most, torch.cuda.device_count()))


def launch(tmp_path: Path, name: str, spec: dict[str, Any], ranks: int, timeout: float = 240) -> list[dict[str, Any]]:
    """Run ``tests.gpu._runs`` with ``spec`` in its own process (Lightning starts the other ranks); return each
    training rank's result."""
    out = tmp_path / name
    spec = {"out": str(out), "batch_size": BATCH, "steps": STEPS, **spec}
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu._runs", str(spec_path)],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout[-8000:]}"
    results = []
    for rank in range(ranks):
        path = Path(f"{out}.rank{rank}.pt")
        assert path.exists(), f"rank {rank} wrote no result; output:\n{proc.stdout[-4000:]}"
        results.append(torch.load(path, weights_only=False))
    return results


def cpu_reference(
    tmp_path: Path, replicas: int = 1, steps: int = STEPS, model: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One CPU process, fp32, on the global batch of ``replicas`` data-parallel ranks: the same rows per step;
    ``model``: the ``Net`` options of the run it stands for."""
    out = tmp_path / "cpu_reference"
    run(
        {
            "strategy": "single",
            "accelerator": "cpu",
            "devices": 1,
            "batch_size": BATCH * replicas,
            "steps": steps,
            "out": str(out),
            "model": model or {},
        }
    )
    return torch.load(f"{out}.rank0.pt", weights_only=False)


def assert_learned(losses: list[float]) -> None:
    """The loss fell: the mean of the last three steps is below 80% of the first three's."""
    assert len(losses) >= 6, losses
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, f"loss did not decrease: {losses}"
