"""The largest-model ladder: TiedGPT shapes growing along a fixed ladder, and one launch climbing it under a cap.

One launch per mode and repeat starts N ranks (``ladder_worker.py``) each in its own capped cgroup (``cgroup.py``)
and trains the rungs in ascending order, a few steps each, in the same processes, until a rung is OOM-killed, fails,
runs past its time, or the ladder ends. The largest rung every rank finished is the launch's figure. This module holds
the ladder and the outcome logic (pure, tested) and the launch (:func:`climb`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import error_line
from ds_lightning.testing import free_port

from .cgroup import RankGroups

__all__ = ["HEAD_DIM", "RUNGS", "climb", "largest", "outcome", "rung_shape", "tied_gpt_parameters"]

#: (d_model, n_layer) of each rung, each about 1.3-1.6x the parameters of the one before (n_head = d_model / 64)
RUNGS: tuple[tuple[int, int], ...] = (
    (128, 2),
    (192, 2),
    (256, 2),
    (256, 4),
    (320, 4),
    (384, 4),
    (384, 6),
    (448, 6),
    (512, 6),
    (512, 8),
    (576, 8),
    (640, 8),
    (640, 10),
    (704, 10),
    (768, 10),
    (768, 12),
    (832, 12),
    (896, 12),
    (896, 14),
    (960, 14),
    (1024, 14),
    (1024, 16),
)
HEAD_DIM = 64
VOCAB = 256


def tied_gpt_parameters(d_model: int, n_layer: int, block_size: int) -> int:
    """TiedGPT's parameter count: per block 12 d^2 + 13 d; the tied token embedding / head, positions, final norm."""
    return n_layer * (12 * d_model**2 + 13 * d_model) + VOCAB * d_model + block_size * d_model + 2 * d_model


def rung_shape(rung: int, block_size: int) -> dict[str, int]:
    """TiedGPT's arguments for rung ``rung`` (an index into :data:`RUNGS`)."""
    d_model, n_layer = RUNGS[rung]
    return {"d_model": d_model, "n_layer": n_layer, "n_head": max(1, d_model // HEAD_DIM), "block_size": block_size}


def largest(finished: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The finished rung with the most parameters (a climb finishes rungs in order; this does not rely on it)."""
    return max(finished, key=lambda r: r["parameters"], default=None)


def outcome(rc: Sequence[int | None], oom_kills: Sequence[int], timed_out: bool, ladder_done: bool) -> str:
    """Why a climb stopped: ``"oom-killed (rank r)"``, ``"timeout"``, ``"error (rank r, exit c)"`` or ``"top"``
    (every rung fitted); an OOM kill explains a rank's exit first, since the others then fail or hang."""
    killed = [r for r, n in enumerate(oom_kills) if n]
    if killed:
        return f"oom-killed (rank {', '.join(map(str, killed))})"
    if timed_out:
        return "timeout"
    failed = [(r, c) for r, c in enumerate(rc) if c not in (0, None)]
    if failed:
        return f"error (rank {failed[0][0]}, exit {failed[0][1]})"
    return "top" if ladder_done else "stopped"


def _read_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def _watch(
    ranks: Sequence[subprocess.Popen[bytes]], groups: RankGroups, start: float, timeout: float
) -> tuple[list[int | None], bool]:
    """Poll every 0.2 s until every rank is done, one failed or was OOM-killed, or ``timeout`` passed; the exit codes
    and whether it timed out."""
    while True:
        rc = [p.poll() for p in ranks]
        if all(c is not None for c in rc) or any(groups.oom_kills()) or any(c not in (0, None) for c in rc):
            return rc, False
        if time.monotonic() - start > timeout:
            return rc, True
        time.sleep(0.2)


def climb(
    worker: Path, spec: dict[str, Any], procs: int, cap_bytes: int, timeout: float, env: Mapping[str, str]
) -> dict[str, Any]:
    """Start ``procs`` ranks of ``worker``, each in a cgroup capped at ``cap_bytes``, and watch them every 0.2 s.

    Stops at the first OOM kill (every rank killed then, never waiting on a hung collective), a rank's failure, or
    ``timeout`` seconds. Returns ``{"finished": [rung records], "outcome", "seconds", "cgroup_peak_bytes", "error"}``.
    """
    with tempfile.TemporaryDirectory(prefix="ds-bench-ladder-") as tmp, RankGroups(procs, cap_bytes) as groups:
        spec = {**spec, "out_dir": tmp, "procs": procs}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(procs)}
        logs = [(Path(tmp) / f"log{r}.txt").open("w") for r in range(procs)]
        start = time.monotonic()
        ranks: list[subprocess.Popen[bytes]] = []
        try:
            for r in range(procs):
                ranks.append(
                    subprocess.Popen(
                        groups.wrap(r, [sys.executable, str(worker), str(spec_path)]),
                        cwd=tmp,
                        env={**env, **rendezvous, "NODE_RANK": "0", "LOCAL_RANK": str(r)},
                        stdout=logs[r],
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            rc, timed_out = _watch(ranks, groups, start, timeout)
            time.sleep(0.3)  # an OOM kill shows in oom_control a moment after the exit it caused
            kills, peaks = groups.oom_kills(), groups.peaks()
        finally:  # every rank goes, however the watch ended (an interrupt too), so the groups can be removed
            for p in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            for log in logs:
                log.close()
        seconds = time.monotonic() - start
        finished = _read_lines(Path(tmp) / "rungs.jsonl")
        stopped = outcome(rc, kills, timed_out, len(finished) == len(spec["rungs"]))
        text = "\n".join((Path(tmp) / f"log{r}.txt").read_text(errors="replace") for r in range(procs))
    return {
        "finished": finished,
        "outcome": stopped,
        "seconds": seconds,
        "cgroup_peak_bytes": peaks,
        "error": error_line(text) if stopped.startswith("error") else "",
    }
