"""One launch of the link-attribution benchmark: ``ds-train fit`` of the mirrored example, one rank per namespace
host, each told the cluster by ``TF_CONFIG`` alone; every rank's exit code, its log, rank 0's report."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from ds_lightning.testing import free_port, netns

CONFIG = harness.REPO / "examples" / "configs" / "mirrored.yaml"
STRATEGY = "ds_lightning.strategies.MirroredStrategy"
# What a clean environment still carries that would tell a task its interface, address or port: the pack must find
# them from TF_CONFIG alone, as in the multi-host tests.
_ENV_DROP = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")


def fit_args(root: Path, opts: argparse.Namespace) -> list[str]:
    """The ``ds-train fit`` arguments of one launch (every rank the same): the test's run, its report into ``root``."""
    hidden = ", ".join(str(h) for h in opts.hidden)
    return [
        "fit",
        f"--config={CONFIG}",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
        f"--trainer.callbacks.output_json={root / 'training.json'}",  # the example's TrainingReport
        f"--model.hidden_sizes=[{hidden}]",
        f"--trainer.max_steps={opts.steps}",
        "--trainer.max_epochs=-1",  # max_steps alone ends the run, whatever --steps
        "--trainer.limit_val_batches=0",
        f"--trainer.strategy={STRATEGY}",
        f"--trainer.strategy.timeout={opts.dist_timeout}",
        "--trainer.callbacks+=ds_lightning.callbacks.DistributedReport",
        "--trainer.callbacks.every_n_steps=0",
        f"--trainer.callbacks.output_dir={root / 'report'}",
        f"--trainer.callbacks.trace_path={root / 'report' / 'trace.json'}",
    ]


def _env(tf_config: dict[str, Any]) -> dict[str, str]:
    env = harness.worker_env(threads=1, rendezvous=False)
    for variable in _ENV_DROP:
        env.pop(variable, None)
    env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def launch(cluster: netns.Cluster, root: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """One rank per host (rank i on host i), all started at once and waited for, every one killed past
    ``opts.timeout`` s. Returns ``{"exit_codes", "timed_out", "launch_s", "logs"}`` (each rank's log text)."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    spec = {"worker": [f"{host.address}:{port}" for host in cluster.hosts]}
    command = [sys.executable, "-m", "ds_lightning.cli", *fit_args(root, opts)]
    procs, logs = [], [root / f"rank{i}.log" for i in range(len(cluster.hosts))]
    start = time.monotonic()
    for i, (host, log) in enumerate(zip(cluster.hosts, logs, strict=True)):
        env = _env({"cluster": spec, "task": {"type": "worker", "index": i}})
        with log.open("w") as out:
            procs.append(host.run(command, cwd=harness.REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, opts.timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for proc in procs:  # each rank runs in a session of its own (Host.run): its whole group goes
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {
        "exit_codes": [proc.returncode for proc in procs],
        "timed_out": timed_out,
        "launch_s": time.monotonic() - start,
        "logs": [log.read_text(errors="replace") for log in logs],
    }


def failure(result: dict[str, Any], report_found: bool) -> str | None:
    """Why a launch gave no result (a rank's exit code, a timeout, no report), naming the rank; ``None`` if it did."""
    codes = result["exit_codes"]
    if result["timed_out"]:
        why = f"timed out after {result['launch_s']:.0f} s, exit codes {codes}"
    elif any(code != 0 for code in codes):
        why = f"exit codes {codes}"
    elif not report_found:
        why = f"exit codes {codes} but rank 0 wrote no report.json"
    else:
        return None
    bad = next((i for i, code in enumerate(codes) if code != 0), 0)
    line = harness.error_line(result["logs"][bad])
    return f"{why} (rank {bad}: {line})" if line else why
