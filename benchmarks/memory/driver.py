"""What does optimizer-state sharding save and cost? ``MirroredStrategy(shard_optimizer_state=True)`` against plain.

Every arm runs ``ds_mirrored`` on N CPU processes (gloo, 1 thread each; ``--procs``, 2 and 4) and trains the
``--model`` workload (``harness/workloads.py``): the 64-1024-1024-10 MLP on the digits under Adam (batch 32 per
process), or the byte-level GPT on the standard library's text under AdamW (batch 8 windows of 128 tokens per
process); plain and sharded at each N, under each ``--engines`` (``sharding_engine``: ``zero``, ``fsdp2``),
interleaved and repeated by the harness. Read at the end of each run, on every rank: the optimizer-state bytes it holds
(``ds_lightning.sharding.optimizer_state_bytes``), the bytes it hands per step to the gradient all-reduce
(``comm_bytes_per_step``), under ``zero`` to ``ZeroRedundancyOptimizer``'s parameter broadcasts (counted from the
parameters it owns), under ``fsdp2`` to FSDP2's all-gathers and reduce-scatters (counted from the shards), and its peak
RSS; rank 0's median step time. Targets (issue 16, sharded / plain of the same repeat, the largest rank's figure):
optimizer state <= 0.55x at 2 ranks and <= 0.30x at 4; step time <= 1.10x; payload bytes per step <= 1.1x (payloads
handed, and under the ring model of ``benchmarks/sharding_engines/driver.py``).

    python -m benchmarks.memory.driver [--quick] [--model digits|gpt] [--repeats 3] [--out DIR] [--render [JSON]]
        [--procs 2 4] [--engines zero fsdp2] [--steps 100] [--warmup 10] [--batch-size 32] [--gpt-layers 4 ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, Panel, fmt
from benchmarks.harness import workloads as _workloads
from benchmarks.sharding_engines import common as _sharding_common
from benchmarks.sharding_engines.common import BYTES_TARGET, OPTIMIZERS, STATE_TARGETS, ring_bytes, workload_label

WORKER = Path(__file__).resolve().parent / "worker.py"

#: reading keys in bytes, and the MB keys the summary and chart use
MB_KEYS = {
    "state_bytes_max": "state_mb_max",
    "state_bytes_min": "state_mb_min",
    "grad_bytes": "grad_mb",
    "broadcast_bytes_max": "broadcast_mb_max",
    "sent_bytes_max": "sent_mb_max",
    "ring_bytes_max": "ring_mb_max",
    "fsdp_bytes_max": "fsdp_mb_max",
}
SUMMARY_KEYS = ["step_ms", *MB_KEYS.values(), "rss_mb_max"]
RATIO_KEYS = ["step_ms", "state_mb_max", "sent_mb_max", "ring_mb_max", "rss_mb_max"]
ENGINES = ("zero", "fsdp2")


def arm_name(sharded: bool, procs: int, engine: str = "zero") -> str:
    """``plain_pN``; ``sharded_pN`` under the zero engine (the name older results carry); ``fsdp2_pN``."""
    return f"{'plain' if not sharded else 'sharded' if engine == 'zero' else engine}_p{procs}"


def arm_title(sharded: bool, procs: int, engine: str = "zero") -> str:
    return f"{'plain' if not sharded else 'sharded' if engine == 'zero' else 'sharded fsdp2'}, {procs} procs"


def reading_of(result: Mapping[str, Any]) -> dict[str, Any]:
    """One run's record from rank 0's ``result.json``: rank 0's median step, and per rank and its largest figures."""
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    state = [r["state_bytes"] for r in ranks]
    sent = [r["grad_bytes"] + r["broadcast_bytes"] for r in ranks]
    rss = [r["peak_rss_mb"] for r in ranks]
    fsdp = [r.get("allgather_bytes", 0) + r.get("reducescatter_bytes", 0) for r in ranks]
    sent = [s + f for s, f in zip(sent, fsdp, strict=True)]
    payloads = [
        {
            "allreduce_bytes": r["grad_bytes"],
            "broadcast_bytes": r["broadcast_bytes"],
            "allgather_bytes": r.get("allgather_bytes", 0),
            "reducescatter_bytes": r.get("reducescatter_bytes", 0),
        }
        for r in ranks
    ]
    return {
        "step_ms": result["median_step_ms"],
        "parameters": result.get("parameters"),
        "optimizer_class": ranks[0]["optimizer_class"],
        "state_bytes_ranks": state,
        "state_bytes_max": max(state),
        "state_bytes_min": min(state),
        "grad_bytes": ranks[0]["grad_bytes"],
        "broadcast_bytes_ranks": [r["broadcast_bytes"] for r in ranks],
        "broadcast_bytes_max": max(r["broadcast_bytes"] for r in ranks),
        "broadcast_calls": ranks[0]["broadcast_calls"],
        "sent_bytes_ranks": sent,
        "sent_bytes_max": max(sent),
        "fsdp_bytes_max": max(fsdp),
        "ring_bytes_max": max(ring_bytes(p, len(ranks)) for p in payloads),
        "rss_mb_ranks": rss,
        "rss_mb_max": max(rss),
    }


def targets(summary: Mapping[str, Any], procs: list[int], engines: list[str]) -> list[dict[str, Any]]:
    """Every target's figure (sharded / plain per repeat) and verdict, per engine and process count."""
    out = []
    for engine in engines:
        prefix = "" if engine == "zero" else f"{engine}: "
        for n in procs:
            checks = (
                (f"{prefix}optimizer-state bytes, largest rank", "state_mb_max", STATE_TARGETS.get(n)),
                (f"{prefix}step time (rank 0's median)", "step_ms", _sharding_common.STEP_TARGET),
                (f"{prefix}payload bytes per step (counted), largest rank", "sent_mb_max", BYTES_TARGET),
                (f"{prefix}payload bytes under a ring model, largest rank", "ring_mb_max", BYTES_TARGET),
                (f"{prefix}peak RSS, largest rank (no target)", "rss_mb_max", None),
            )
            out += _sharding_common.judged(summary.get(arm_name(True, n, engine), {}), n, checks)
    return out


class Memory(harness.Benchmark):
    name = "memory"
    description = __doc__
    models = ("digits", "gpt")
    defaults = {"repeats": 3}
    quick = {"repeats": 1}

    def options(self, parser: argparse.ArgumentParser) -> None:
        _sharding_common.add_options(parser)
        parser.add_argument(
            "--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="sharding engines (zero fsdp2)"
        )

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        return _sharding_common.meta(opts)

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [
            Arm(arm_name(sharded, n, engine), {"procs": n, "sharded": sharded, "engine": engine}, title)
            for n in opts.procs
            for sharded, engine in ((False, "zero"), *((True, e) for e in opts.engines))
            for title in [arm_title(sharded, n, engine)]
        ]
        return Experiment(arms, opts.repeats)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {**arm.params, "hidden": opts.hidden, "batch_size": opts.batch_size}
        spec.update(steps=opts.steps, warmup=opts.warmup, workload=_workloads.spec_of(opts))
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1))
        return {"rc": found["rc"], **reading_of(found["result"])}

    def progress(self, record: dict[str, Any]) -> str:
        return _sharding_common.progress(record)

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        procs = data["settings"]["procs"]  # sharded over plain of the same process count, per repeat
        engines = data["settings"].get("engines", ["zero"])  # results from before fsdp2: zero only
        pairs = [(arm_name(True, n, e), arm_name(False, n)) for n in procs for e in engines]
        s = _sharding_common.summarise(data, MB_KEYS, SUMMARY_KEYS, RATIO_KEYS, pairs)
        s["targets"] = targets(s, procs, engines)
        s["verdicts"] = _sharding_common.verdicts(s["targets"])
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, st = data["summary"], data["settings"]
        model = data.get("workload", {}).get("model", "digits")
        rows = []
        for arm, title in data["arms"].items():
            v = s[arm]
            rows.append(
                [
                    title,
                    _sharding_common.per_rank_state(v["first"] or {}),
                    fmt(v["step_ms"], ".2f"),
                    fmt(v["grad_mb"], ".3f"),
                    fmt(v["broadcast_mb_max"], ".3f"),
                    fmt(v.get("fsdp_mb_max"), ".3f"),
                    fmt(v["sent_mb_max"], ".3f"),
                    fmt(v.get("ring_mb_max"), ".3f"),
                    fmt(v["rss_mb_max"], ".0f"),
                ]
            )
        target_rows = [[t["what"], t["procs"], *_sharding_common.target_cells(t)] for t in s["targets"]]
        return [
            f"# Optimizer-state sharding on the {workload_label(data)}",
            "",
            "`MirroredStrategy(shard_optimizer_state=True)` (`sharding_engine='zero'`: ZeRO stage 1 on torch's"
            " `ZeroRedundancyOptimizer`; `'fsdp2'`: torch's `fully_shard`, where run) against plain `ds_mirrored`,"
            f" on {' and '.join(str(n) for n in st['procs'])} CPU processes (gloo,"
            f" 1 thread each); {OPTIMIZERS.get(model, '?')}; {_sharding_common.parameters(data)} parameters; batch"
            f" {_sharding_common.batch(data)} per process;"
            f" {st['warmup']} warm-up + {st['steps']} timed steps per run; {st['repeats']} interleaved"
            " repeat(s). Median [min - max] over repeats; each ratio is sharded / plain of the same process count and"
            " repeat.",
            "",
            *harness.markdown_table(
                [
                    "arm",
                    "optimizer state per rank (MB, rank 0 / 1 / ...)",
                    "step (ms)",
                    "gradient all-reduce (MB/step/rank)",
                    "parameter broadcast (MB/step, largest rank)",
                    "FSDP2 all-gather + reduce-scatter (MB/step, largest rank)",
                    "payload (MB/step, largest rank, counted)",
                    "ring model (MB/step, largest rank)",
                    "peak RSS (MB, largest rank)",
                ],
                rows,
            ),
            "",
            *harness.markdown_table(["target", "processes", "sharded / plain", "limit", "verdict"], target_rows),
            "",
            "- Optimizer state: `ds_lightning.sharding.optimizer_state_bytes` on every rank after the last step (all"
            " of its state tensors); the target is judged on the largest rank's, since torch partitions whole"
            " parameters (largest first, each to the least-loaded rank).",
            "- Payload bytes are **counted from the collectives' payloads, not measured on a wire**: the gradient"
            " all-reduce's payload (`comm_bytes_per_step`) plus, sharded, the parameters a rank broadcasts as their"
            " owner after its step (torch's `ZeroRedundancyOptimizer` broadcasts every parameter from its owner rank,"
            f" {calls_of(s, data['arms'])} broadcasts per step that every rank joins) or, under fsdp2, the"
            " all-gather input (the rank's padded shard of every parameter, once per step with"
            " `reshard_after_forward=False`) plus the reduce-scatter input (every gradient whole, padded). How many"
            " times a payload crosses a link depends on the collective's algorithm; the ring model counts what a ring"
            " sends: 2(N-1)/N of an all-reduce, (N-1) shards of an all-gather, (N-1)/N of a reduce-scatter, a"
            " broadcast once from its owner (a lower bound for zero).",
            "- Peak RSS is each rank's `ru_maxrss` at the end of training: coarse (Python, torch and the data included;"
            " rank 0 also launches the others).",
            *_sharding_common.failed(data),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        return _sharding_common.plot(
            self,
            data,
            out,
            Panel("sent_mb_max", "payload per step, largest rank (MB, counted)", "sent_mb_max_ratio"),
            f"Optimizer-state sharding on the {workload_label(data)}",
            {
                a: "tab:orange" if a.startswith("sharded") else "tab:green" if a.startswith("fsdp2") else "tab:blue"
                for a in data["arms"]
            },
        )


def calls_of(summary: Mapping[str, Any], arms: Mapping[str, str]) -> str:
    """The broadcasts per step of the sharded runs (``-`` when none ran)."""
    calls = sorted({v["first"]["broadcast_calls"] for a, v in summary.items() if a in arms and v["first"]} - {0})
    return " or ".join(str(c) for c in calls) or "-"


if __name__ == "__main__":
    harness.main(Memory())
