"""The faults benchmark's recovery on the network-namespace cluster, one TF_CONFIG task per host (see ``README.md``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks import harness
from ds_lightning.testing import free_port, netns

HOSTS = 3


class Layout(NamedTuple):
    """Which host runs which TF_CONFIG task, and which host is lost."""

    jobs: dict[str, list[int]]
    victim: int
    label: str


LAYOUTS = {
    "ds_mirrored": Layout({"worker": [0, 1]}, 1, "ds_mirrored, host 1 lost (netns)"),
    "ds_pipeline": Layout({"worker": [0, 1]}, 1, "ds_pipeline, stage 2's host lost (netns)"),
    "ds_parameter_server": Layout(
        {"chief": [0], "worker": [1], "ps": [2]}, 2, "ds_parameter_server, the server's host lost (netns)"
    ),
}


def read_lines(path: Path) -> list[dict[str, Any]]:
    """JSON lines; a line cut short by the kill is left out."""
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def recover(
    cluster: netns.Cluster, layout: Layout, worker: Path, spec: dict[str, Any], tmp: str, kill_at: int, timeout: float
) -> dict[str, Any]:
    """A run killed at ``kill_at`` and its re-run; returns their exit codes (rank 0's) and the re-run's last step."""
    stamps = Path(spec["stamp_dir"], "stamps.jsonl")
    first = _launch(cluster, layout, worker, spec, Path(tmp, "first"), kill_at, timeout)
    if not stamps.exists() or not any(s["event"] == "kill" for s in read_lines(stamps)):
        raise harness.Failed(f"the first launch ended before step {kill_at} (exit codes {first})")
    second = _launch(cluster, layout, worker, spec, Path(tmp, "again"), None, timeout)
    result = Path(tmp, "again", "result.json")
    if not result.exists():
        raise harness.Failed(f"the re-run wrote no result (exit codes {second}; logs in {tmp})")
    return {"rc": second[0], "first_rc": first[0], "last_step": json.loads(result.read_text())["last_step"]}


def _launch(
    cluster: netns.Cluster,
    layout: Layout,
    worker: Path,
    spec: dict[str, Any],
    out: Path,
    kill_at: int | None,
    timeout: float,
) -> list[int | None]:
    """Every task, servers first; with ``kill_at``, the victim host killed once rank 0 did that step. Returns the exit
    codes, rank 0's (the first ``chief`` or ``worker`` task) first."""
    out.mkdir()
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({**spec, "out_dir": str(out)}))
    port = free_port()
    tf_cluster = {job: [f"{cluster.hosts[i].address}:{port}" for i in hosts] for job, hosts in layout.jobs.items()}
    order = [(job, i, h) for job in ("ps", "chief", "worker") for i, h in enumerate(layout.jobs.get(job, []))]
    procs = []
    for job, index, host in order:  # servers first, as an operator would
        env = harness.worker_env(threads=1, rendezvous=False)
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(variable, None)
        env["TF_CONFIG"] = json.dumps({"cluster": tf_cluster, "task": {"type": job, "index": index}})
        with (out / f"{job}{index}.log").open("w") as log:
            cmd = [sys.executable, str(worker), str(spec_path)]
            procs.append(cluster.hosts[host].run(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT))
    stamps = Path(spec["stamp_dir"], "stamps.jsonl")
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if kill_at is not None and stamps.exists():
            step = max((s["step"] for s in read_lines(stamps) if s["event"] == "step"), default=-1)
            if step >= kill_at:
                with stamps.open("a") as f:
                    f.write(json.dumps({"event": "kill", "t": time.time(), "pid": os.getpid(), "step": step}) + "\n")
                cluster.kill(cluster.hosts[layout.victim])
                kill_at = None
        time.sleep(0.02)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    servers = len(layout.jobs.get("ps", []))
    return [p.returncode for p in procs[servers:] + procs[:servers]]
