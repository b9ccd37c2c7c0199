"""The cluster benchmark's plumbing: shaping and probing the namespace cluster's links, and launching one process per
TF_CONFIG task on its own host."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.cluster.report import WORKERS
from ds_lightning.testing import free_port, netns

WORKER = Path(__file__).resolve().parent / "worker.py"
_ENV_DROP = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
_GRACE_S = 15.0  # how long the other tasks of a launch may run on after one of them failed
LAUNCHES: list[dict[str, Any]] = []  # every launch: its configurations, duration, time to import, exit codes

# A link probe without torch: the sender sends argv[2] bytes to argv[1]:argv[3], the receiver times them.
_SEND_CODE = """import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[3])), timeout=60)
left = int(sys.argv[2]); chunk = b'x' * (1 << 20)
while left > 0:
    s.sendall(chunk[: min(left, len(chunk))]); left -= len(chunk)
s.close()
"""
_RECEIVE_CODE = """import socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2]))); srv.settimeout(60)
print('ready', flush=True)
conn, _ = srv.accept(); conn.settimeout(60); got = 0; start = None
while True:
    data = conn.recv(1 << 20)
    if not data: break
    if start is None: start = time.perf_counter()
    got += len(data)
print(got, time.perf_counter() - start, flush=True)
"""


def _unshape(cluster: netns.Cluster) -> None:
    for host in cluster.hosts:
        cluster.unshape(host)


def shape_links(cluster: netns.Cluster, rates: dict[int, tuple[float, float | None]]) -> dict[str, Any]:
    """Host i's link shaped to ``rates[i]`` = (Mbit/s, delay ms or None), every other host's unshaped; raises
    ``netns.ShapingUnsupportedError`` (links left unshaped) for a delay on a kernel without netem."""
    _unshape(cluster)
    try:
        kinds = {
            i: cluster.shape(cluster.hosts[i], rate_mbit=rate, delay_ms=delay) for i, (rate, delay) in rates.items()
        }
    except netns.ShapingUnsupportedError:
        _unshape(cluster)
        raise
    return {"qdisc": kinds, "tc": {i: cluster.qdiscs(cluster.hosts[i])[0].strip() for i in rates}}


def probe_link(cluster: netns.Cluster, src: int, dst: int, mbytes: float) -> float | None:
    """TCP throughput from host ``src`` to host ``dst`` in Mbit/s (``mbytes`` MB sent), or None if the probe failed."""
    receiver, sender = cluster.hosts[dst], cluster.hosts[src]
    port = str(free_port())
    code = [sys.executable, "-I", "-S", "-c"]
    recv = receiver.run(
        [*code, _RECEIVE_CODE, receiver.address, port], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            return None
        sender.check_output([*code, _SEND_CODE, receiver.address, str(int(mbytes * 1e6)), port], 120)
        got, seconds = recv.communicate(timeout=60)[0].split()
        return int(got) * 8 / float(seconds) / 1e6
    except (subprocess.SubprocessError, ValueError, OSError, AssertionError):
        return None
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()


def _tasks(cluster: netns.Cluster, with_ps: bool) -> tuple[dict[str, Any], list[tuple[int, str, int]]]:
    """The cluster spec and the (host, task type, task index) of every task: workers on hosts 0 and 1, ps on 2."""
    port = free_port()
    address = [f"{host.address}:{port}" for host in cluster.hosts]
    if with_ps:
        spec = {"chief": [address[0]], "worker": [address[1]], "ps": [address[2]]}
        return spec, [(0, "chief", 0), (1, "worker", 0), (2, "ps", 0)]
    return {"worker": address[:WORKERS]}, [(i, "worker", i) for i in range(WORKERS)]


def launch(
    cluster: netns.Cluster, spec: dict[str, Any], configs: list[dict[str, Any]], opts: argparse.Namespace
) -> dict[str, Any]:
    """One process per task on its own host, running ``configs`` in order; their records, or why they stopped. Killed
    when a configuration takes over ``opts.timeout`` s, or ``_GRACE_S`` after any task failed."""
    tmp = Path(tempfile.mkdtemp(prefix="ds-cluster-bench-"))
    try:
        records = tmp / "records"
        records.mkdir()
        ranks = WORKERS * spec.get("devices", 1)  # every training process writes a record
        paths = {c["name"]: [records / f"{c['name']}.rank{r}.json" for r in range(ranks)] for c in configs}
        tf_cluster, tasks = _tasks(cluster, spec.get("with_ps", False))
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps({**spec, "configs": configs, "records": str(records)}))
        procs, logs = [], [tmp / f"{task_type}{index}.log" for _, task_type, index in tasks]
        start = progress = time.monotonic()
        wall_start = time.time()
        for (host, task_type, index), log in zip(tasks, logs, strict=True):
            env = harness.worker_env(threads=1, rendezvous=False)
            for variable in _ENV_DROP:
                env.pop(variable, None)
            env["TF_CONFIG"] = json.dumps({"cluster": tf_cluster, "task": {"type": task_type, "index": index}})
            with log.open("w") as out:
                command = [sys.executable, str(WORKER), str(spec_path)]
                procs.append(cluster.hosts[host].run(command, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT))
        done, reason, failed_at = 0, None, None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            finished = sum(all(p.exists() for p in found) for found in paths.values())
            if finished > done:
                done, progress = finished, now
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now - progress > opts.timeout:
                reason = f"timed out after {opts.timeout:.0f} s"
                break
            if failed_at is not None and now - failed_at > _GRACE_S:
                break
            time.sleep(0.2)
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rcs = [p.returncode for p in procs]
        result: dict[str, Any] = {"launch_s": time.monotonic() - start, "exit_codes": rcs, "records": {}}
        for name, found in paths.items():
            if all(p.exists() for p in found):
                result["records"][name] = {rank: json.loads(p.read_text()) for rank, p in enumerate(found)}
        imported = [json.loads(p.read_text())["imported_at"] for p in records.glob("started.*")]
        result["import_s"] = max(imported) - wall_start if imported else None
        if len(result["records"]) < len(configs):
            texts = [log.read_text(errors="replace") for log in logs]
            why = reason or "exit codes " + ", ".join(f"{t[1]}{t[2]}={rc}" for t, rc in zip(tasks, rcs, strict=True))
            errors = [e for e in map(harness.error_line, texts) if e]
            result["error"] = why + (f", {errors[0]}" if errors else "")
            result["log_tail"] = "\n".join(f"--- {log.name}\n{t[-1500:]}" for log, t in zip(logs, texts, strict=True))
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_configs(
    cluster: netns.Cluster, spec: dict[str, Any], configs: list[dict[str, Any]], opts: argparse.Namespace
) -> dict[str, Any]:
    """Every configuration's records by rank (or ``{"error": ...}``): a failed configuration is recorded, the ones after
    it launched again."""
    out: dict[str, Any] = {}
    remaining = list(configs)
    while remaining:
        result = launch(cluster, spec, remaining, opts)
        names = [c["name"] for c in remaining]
        LAUNCHES.append({"kind": spec["kind"], "configs": names, "error": result.get("error")})
        LAUNCHES[-1] |= {k: result[k] for k in ("launch_s", "import_s", "exit_codes")}
        error = f", FAILED {result['error']}" if "error" in result else ""
        print(f"  {spec['kind']} launch of {', '.join(names)}: {result['launch_s']:.0f} s{error}", flush=True)
        failed = next((i for i, n in enumerate(names) if n not in result["records"]), len(names))
        out |= {n: result["records"][n] for n in names[:failed]}
        if failed < len(names):
            out[names[failed]] = {"error": result.get("error", "no records"), "log_tail": result.get("log_tail", "")}
        remaining = remaining[failed + 1 :]
    return out
