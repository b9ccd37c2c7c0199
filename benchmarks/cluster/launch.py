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

# Sends argv[2] bytes to argv[1]:argv[3] (the receiver times them); a link probe without torch.
_SEND_CODE = (
    "import socket, sys\n"
    "s = socket.create_connection((sys.argv[1], int(sys.argv[3])), timeout=60)\n"
    "left = int(sys.argv[2]); chunk = b'x' * (1 << 20)\n"
    "while left > 0:\n"
    "    s.sendall(chunk[: min(left, len(chunk))]); left -= len(chunk)\n"
    "s.close()\n"
)
_RECEIVE_CODE = (
    "import socket, sys, time\n"
    "srv = socket.create_server((sys.argv[1], int(sys.argv[2]))); srv.settimeout(60)\n"
    "print('ready', flush=True)\n"
    "conn, _ = srv.accept(); conn.settimeout(60); got = 0; start = None\n"
    "while True:\n"
    "    data = conn.recv(1 << 20)\n"
    "    if not data: break\n"
    "    if start is None: start = time.perf_counter()\n"
    "    got += len(data)\n"
    "print(got, time.perf_counter() - start, flush=True)\n"
)


def shape_links(cluster: netns.Cluster, rates: dict[int, tuple[float, float | None]]) -> dict[str, Any]:
    """Host i's link shaped to ``rates[i]`` = (Mbit/s, delay ms or None), every other host's unshaped; raises
    ``netns.ShapingUnsupportedError`` (links left unshaped) for a delay on a kernel without netem."""
    for host in cluster.hosts:
        cluster.unshape(host)
    kinds = {}
    try:
        for index, (rate, delay) in rates.items():
            kinds[index] = cluster.shape(cluster.hosts[index], rate_mbit=rate, delay_ms=delay)
    except netns.ShapingUnsupportedError:
        for host in cluster.hosts:
            cluster.unshape(host)
        raise
    return {"qdisc": kinds, "tc": {i: cluster.qdiscs(cluster.hosts[i])[0].strip() for i in rates}}


def probe_link(cluster: netns.Cluster, src: int, dst: int, mbytes: float) -> float | None:
    """TCP throughput from host ``src`` to host ``dst`` in Mbit/s (``mbytes`` MB sent), or None if the probe failed."""
    receiver, sender = cluster.hosts[dst], cluster.hosts[src]
    port = free_port()
    recv = receiver.run(
        [sys.executable, "-I", "-S", "-c", _RECEIVE_CODE, receiver.address, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            return None
        size = int(mbytes * 1e6)
        sender.check_output([sys.executable, "-I", "-S", "-c", _SEND_CODE, receiver.address, str(size), str(port)], 120)
        out, _ = recv.communicate(timeout=60)
        got, seconds = out.split()
        return int(got) * 8 / float(seconds) / 1e6
    except (subprocess.SubprocessError, ValueError, OSError, AssertionError):
        return None
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()


def _tf_config(cluster: netns.Cluster, with_ps: bool, port: int) -> tuple[dict[str, Any], list[tuple[int, str, int]]]:
    """The cluster spec and the (host, task type, task index) of every task: workers on hosts 0 and 1, ps on 2."""
    address = [f"{host.address}:{port}" for host in cluster.hosts]
    if with_ps:
        return (
            {"chief": [address[0]], "worker": [address[1]], "ps": [address[2]]},
            [(0, "chief", 0), (1, "worker", 0), (2, "ps", 0)],
        )
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
        tf_cluster, tasks = _tf_config(cluster, spec.get("with_ps", False), free_port())
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps({**spec, "configs": configs, "records": str(records)}))
        procs, logs = [], []
        start = progress = time.monotonic()
        wall_start = time.time()
        for host_index, task_type, task_index in tasks:
            env = harness.worker_env(threads=1, rendezvous=False)
            for variable in _ENV_DROP:
                env.pop(variable, None)
            env["TF_CONFIG"] = json.dumps({"cluster": tf_cluster, "task": {"type": task_type, "index": task_index}})
            log = tmp / f"{task_type}{task_index}.log"
            logs.append(log)
            with log.open("w") as out:
                procs.append(
                    cluster.hosts[host_index].run(
                        [sys.executable, str(WORKER), str(spec_path)],
                        cwd=tmp,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        done, reason = 0, None
        failed_at: float | None = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            finished = sum(all((records / f"{c['name']}.rank{r}.json").exists() for r in range(ranks)) for c in configs)
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
        texts = [log.read_text(errors="replace") for log in logs]
        result: dict[str, Any] = {"launch_s": time.monotonic() - start, "exit_codes": rcs, "records": {}}
        for config in configs:
            found = {}
            for rank in range(ranks):
                path = records / f"{config['name']}.rank{rank}.json"
                if path.exists():
                    found[rank] = json.loads(path.read_text())
            if len(found) == ranks:
                result["records"][config["name"]] = found
        imported = [json.loads(p.read_text())["imported_at"] for p in records.glob("started.*")]
        result["import_s"] = max(imported) - wall_start if imported else None
        if len(result["records"]) < len(configs):
            why = reason or "exit codes " + ", ".join(f"{t[1]}{t[2]}={rc}" for t, rc in zip(tasks, rcs, strict=True))
            errors = [e for e in (harness.error_line(t) for t in texts) if e]
            result["error"] = why + (f", {errors[0]}" if errors else "")
            result["log_tail"] = "\n".join(f"--- {log.name}\n{t[-1500:]}" for log, t in zip(logs, texts, strict=True))
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_configs(
    cluster: netns.Cluster, spec: dict[str, Any], configs: list[dict[str, Any]], opts: argparse.Namespace
) -> tuple[dict[str, dict[int, dict[str, Any]] | dict[str, Any]], list[float]]:
    """Every configuration's records (or ``{"error": ...}``) and every launch's duration: a failed configuration is
    recorded, the rest launched again."""
    out: dict[str, Any] = {}
    launches: list[float] = []
    remaining = list(configs)
    while remaining:
        result = launch(cluster, spec, remaining, opts)
        launches.append(result["launch_s"])
        names = [c["name"] for c in remaining]
        LAUNCHES.append({"kind": spec["kind"], "configs": names, "error": result.get("error")})
        LAUNCHES[-1] |= {k: result[k] for k in ("launch_s", "import_s", "exit_codes")}
        for i, config in enumerate(remaining):
            name = config["name"]
            if name in result["records"]:
                out[name] = result["records"][name]
                continue
            out[name] = {"error": result.get("error", "no records"), "log_tail": result.get("log_tail", "")}
            print(f"    {name}: FAILED {out[name]['error']}", flush=True)
            remaining = remaining[i + 1 :]
            break
        else:
            remaining = []
    return out, launches
