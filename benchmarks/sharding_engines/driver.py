"""Which engine should shard the optimizer state? DDP + ZeroRedundancyOptimizer against FSDP2, both against plain DDP.

Plain torch training loops, no Lightning (``benchmarks/sharding_engines/worker.py``), on N CPU processes (gloo,
1 thread each; ``--procs``, 2 and 4), training the ``--model`` workload (``harness/workloads.py``): the
64-1024-1024-10 MLP on the digits under Adam (batch 32 per process), or the byte-level GPT under AdamW (batch 8
windows of 128 tokens per process). Three engines at each N, interleaved and repeated by the harness: ``ddp``
(DistributedDataParallel, the whole optimizer on every rank), ``zero`` (DistributedDataParallel and torch's
``ZeroRedundancyOptimizer``, as ``ds_lightning.sharding`` wraps it) and ``fsdp`` (FSDP2 ``fully_shard`` with
``reshard_after_forward=False`` on the units ``MirroredStrategy(sharding_engine="fsdp2")`` shards, then the root).
Read per run: every rank's optimizer-state bytes and payload bytes per step (counted), rank 0's median step, and the
largest difference of the final parameters from the ``ddp`` run of the same repeat (same seed, same batches). Issue
16's targets, engine / ddp of the same repeat: state <= 0.55x at 2 ranks and <= 0.30x at 4, step time <= 1.10x,
payload bytes <= 1.1x.

    python -m benchmarks.sharding_engines.driver [--quick] [--model digits|gpt] [--repeats 3] [--out DIR]
        [--render [JSON]]
        [--procs 2 4] [--steps 100] [--warmup 10] [--batch-size 32] [--gpt-layers 4 --gpt-heads 4 ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, Panel
from benchmarks.harness import workloads as _workloads
from benchmarks.sharding_engines import common as _sharding_common
from benchmarks.sharding_engines import report as _sharding_engines_report
from benchmarks.sharding_engines.common import (
    BYTES_TARGET,
    PARITY_ATOL,
    STATE_TARGETS,
    STEP_TARGET,
    ring_bytes,
    workload_label,
)

WORKER = Path(__file__).resolve().parent / "worker.py"
ENGINES = {
    "ddp": "DDP + whole optimizer",
    "zero": "DDP + ZeroRedundancyOptimizer",
    "fsdp": "FSDP2 fully_shard(reshard_after_forward=False)",
}
COLORS = {"ddp": "tab:blue", "zero": "tab:orange", "fsdp": "tab:green"}
BYTE_KEYS = ("allreduce_bytes", "broadcast_bytes", "allgather_bytes", "reducescatter_bytes")
MB_KEYS = {
    "state_bytes_max": "state_mb_max",
    "sent_bytes_max": "sent_mb_max",
    "ring_bytes_max": "ring_mb_max",
    **{k: k.replace("_bytes", "_mb") for k in BYTE_KEYS},
}
SUMMARY_KEYS = ["step_ms", *MB_KEYS.values(), "rss_mb_max", "parity_max_abs"]
RATIO_KEYS = ["step_ms", "state_mb_max", "sent_mb_max", "ring_mb_max"]


def arm_name(engine: str, procs: int) -> str:
    return f"{engine}_p{procs}"


def reading_of(result: Mapping[str, Any]) -> dict[str, Any]:
    """One run's record from rank 0's ``result.json``: rank 0's median step, per rank and the largest figures."""
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    world = len(ranks)
    state = [r["state_bytes"] for r in ranks]
    sent = [sum(r[k] for k in BYTE_KEYS) for r in ranks]
    ring = [ring_bytes(r, world) for r in ranks]
    largest = max(range(world), key=sent.__getitem__)
    return {
        "step_ms": result["median_step_ms"],
        "parameters": result.get("parameters"),
        "optimizer_class": ranks[0]["optimizer_class"],
        "state_bytes_ranks": state,
        "state_bytes_max": max(state),
        "sent_bytes_ranks": sent,
        "sent_bytes_max": max(sent),
        "ring_bytes_max": max(ring),
        **{k: ranks[largest][k] for k in BYTE_KEYS},  # the parts of the largest rank's sum
        "rss_mb_max": max(r["peak_rss_mb"] for r in ranks),
    }


def parity(records: list[dict[str, Any]], params: Mapping[tuple[str, int], torch.Tensor]) -> None:
    """Set each record's ``parity_max_abs``: its final parameters' largest difference from the same repeat's ``ddp``
    run at the same process count (``None`` when either is missing)."""
    for r in records:
        if "error" in r:
            continue
        mine = params.get((r["arm"], r["repeat"]))
        base = params.get((arm_name("ddp", int(r["arm"].rsplit("_p", 1)[1])), r["repeat"]))
        if mine is None or base is None or mine.shape != base.shape:
            r["parity_max_abs"] = None
        else:
            r["parity_max_abs"] = float((mine - base).abs().max())


def targets(summary: Mapping[str, Any], procs: list[int]) -> list[dict[str, Any]]:
    """Every target's figure (engine / ddp per repeat) and verdict, per sharding engine and process count."""
    out = []
    for n in procs:
        for engine in ("zero", "fsdp"):
            checks = (
                ("optimizer-state bytes, largest rank", "state_mb_max", STATE_TARGETS.get(n)),
                ("step time (rank 0's median)", "step_ms", STEP_TARGET),
                ("payload handed to collectives, largest rank", "sent_mb_max", BYTES_TARGET),
                ("payload bytes under a ring model, largest rank", "ring_mb_max", BYTES_TARGET),
            )
            judged = _sharding_common.judged(summary.get(arm_name(engine, n), {}), n, checks)
            out += [{"engine": engine, **t} for t in judged]
    return out


def parity_verdicts(summary: Mapping[str, Any], procs: list[int]) -> list[dict[str, Any]]:
    """The README's parity target: every run's final parameters within ``PARITY_ATOL`` of the same repeat's ``ddp``
    run (the figure: the largest difference per run, over the repeats)."""
    out = []
    for n in procs:
        for engine in ("zero", "fsdp"):
            diff = summary.get(arm_name(engine, n), {}).get("parity_max_abs")
            out.append(
                harness.judged(
                    f"{engine}: final parameters, largest difference from ddp's, {n} processes",
                    diff,
                    at_most=PARITY_ATOL,
                    spec="g",
                    holds=diff["max"] <= PARITY_ATOL if diff else None,
                )
            )
    return out


class ShardingEngines(harness.Benchmark):
    name = "sharding_engines"
    description = __doc__
    models = ("digits", "gpt")
    defaults = {"repeats": 3}
    quick = {"repeats": 1}

    def options(self, parser: argparse.ArgumentParser) -> None:
        _sharding_common.add_options(parser)  # the memory benchmark's: the same workloads and runs

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        return _sharding_common.meta(opts)

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [Arm(arm_name(e, n), {"procs": n, "engine": e}, f"{e}, {n} procs") for n in opts.procs for e in ENGINES]
        return Experiment(arms, opts.repeats)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        path = Path(self._params_dir, f"{arm.name}_r{repeat}.pt")
        spec = {**arm.params, "hidden": opts.hidden, "batch_size": opts.batch_size, "params_path": str(path)}
        spec.update(steps=opts.steps, warmup=opts.warmup, workload=_workloads.spec_of(opts), timeout=opts.timeout)
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1))
        return {"rc": found["rc"], **reading_of(found["result"])}

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="ds-sharding-params-") as tmp:
            self._params_dir = tmp
            data = super().collect(opts)
            found = {}
            for r in data["records"]:
                path = Path(tmp, f"{r['arm']}_r{r['repeat']}.pt")
                if path.exists():
                    found[(r["arm"], r["repeat"])] = torch.load(path)
        parity(data["records"], found)
        return data

    def progress(self, record: dict[str, Any]) -> str:
        return _sharding_common.progress(record)

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        procs = data["settings"]["procs"]
        pairs = [(arm_name(e, n), arm_name("ddp", n)) for n in procs for e in ("zero", "fsdp")]
        s = _sharding_common.summarise(data, MB_KEYS, SUMMARY_KEYS, RATIO_KEYS, pairs)
        s["targets"] = targets(s, procs)
        s["verdicts"] = [*_sharding_common.verdicts(s["targets"]), *parity_verdicts(s, procs)]
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        return _sharding_engines_report.report(data)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        return _sharding_common.plot(
            self,
            data,
            out,
            Panel("ring_mb_max", "payload per step, ring model (MB, counted)", "ring_mb_max_ratio"),
            f"Sharding engines on the {workload_label(data)}",
            {a: COLORS[a.split("_")[0]] for a in data["arms"]},
        )


if __name__ == "__main__":
    harness.main(ShardingEngines())
