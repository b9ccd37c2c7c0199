"""What does ``MirroredStrategy(shard_optimizer_state=True)`` (engine zero or fsdp2) save and cost against plain
``ds_mirrored``? Arms, targets and what a full run does: ``README.md``.

    python -m benchmarks.memory.driver [--quick] [--model digits|gpt] [--procs 2 4] [--engines zero fsdp2] ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, Panel, fmt
from benchmarks.sharding_engines import common

SUMMARY_KEYS = ["step_ms", "state_mb_max", "state_mb_min", "grad_mb", "broadcast_mb_max", "fsdp_mb_max"]
SUMMARY_KEYS += ["sent_mb_max", "ring_mb_max", "rss_mb_max"]
MB_COLUMNS = ("grad_mb", "broadcast_mb_max", "fsdp_mb_max", "sent_mb_max", "ring_mb_max")
ENGINES = ("zero", "fsdp2")
COLUMNS = ["arm", "optimizer state per rank (MB, rank 0 / 1 / ...)", "step (ms)"]
COLUMNS += ["gradient all-reduce (MB/step/rank)", "parameter broadcast (MB/step, largest rank)"]
COLUMNS += ["FSDP2 all-gather + reduce-scatter (MB/step, largest rank)", "payload (MB/step, largest rank, counted)"]
COLUMNS += ["ring model (MB/step, largest rank)", "peak RSS (MB, largest rank)"]
INTRO = (
    "`MirroredStrategy(shard_optimizer_state=True)` (`sharding_engine='zero'`: ZeRO stage 1 on torch's"
    " `ZeroRedundancyOptimizer`; `'fsdp2'`: torch's `fully_shard`, where run) against plain `ds_mirrored`,"
    " on {procs} CPU processes (gloo, 1 thread each);"
)
NOTES = [
    "- Optimizer state: `ds_lightning.sharding.optimizer_state_bytes` of every rank after the last step, judged on"
    " the largest rank's (torch partitions whole parameters).",
    "- Payload bytes are **counted from the collectives' payloads, not measured on a wire** (zero: {calls}"
    " broadcasts per step that every rank joins); what each column counts, and the ring model:"
    " [the README](../memory/README.md).",
    "- Peak RSS: each rank's `ru_maxrss` at the end of training (coarse: Python, torch and the data included).",
]


def arm_name(sharded: bool, procs: int, engine: str = "zero") -> str:
    """``plain_pN``, ``sharded_pN`` (the zero engine) or ``fsdp2_pN``."""
    return f"{'plain' if not sharded else 'sharded' if engine == 'zero' else engine}_p{procs}"


def arm_title(sharded: bool, procs: int, engine: str = "zero") -> str:
    return f"{'plain' if not sharded else 'sharded' if engine == 'zero' else 'sharded fsdp2'}, {procs} procs"


class Memory(common.ShardingBenchmark):
    name = "memory"
    description = __doc__
    worker = Path(__file__).resolve().parent / "worker.py"
    title = "Optimizer-state sharding"
    summary_keys = SUMMARY_KEYS
    ratio_keys = ("step_ms", "state_mb_max", "sent_mb_max", "ring_mb_max", "rss_mb_max")
    bytes_panel = Panel("sent_mb_max", "payload per step, largest rank (MB, counted)", "sent_mb_max_ratio")
    colors = {"sharded": "tab:orange", "fsdp2": "tab:green", "plain": "tab:blue"}

    def options(self, parser: argparse.ArgumentParser) -> None:
        super().options(parser)
        parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="(zero fsdp2)")

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        runs = [(False, "zero"), *((True, e) for e in opts.engines)]
        arms = [
            Arm(arm_name(s, n, e), {"procs": n, "sharded": s, "engine": e}, arm_title(s, n, e))
            for n in opts.procs
            for s, e in runs
        ]
        return Experiment(arms, opts.repeats)

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        procs, engines = data["settings"]["procs"], data["settings"]["engines"]
        s = self.spreads(data, [(arm_name(True, n, e), arm_name(False, n)) for n in procs for e in engines])
        s["targets"] = []
        for e in engines:
            prefix = "" if e == "zero" else f"{e}: "
            for n in procs:
                checks = common.checks(n, prefix, "payload bytes per step (counted)")
                checks.append((f"{prefix}peak RSS, largest rank (no target)", "rss_mb_max", None))
                s["targets"] += common.judged(s.get(arm_name(True, n, e), {}), n, checks)
        s["verdicts"] = common.verdicts(s["targets"])
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s = data["summary"]
        rows = [
            [title, common.rank_state(s[a]["first"]), fmt(s[a]["step_ms"], ".2f")]
            + [fmt(s[a][k], ".3f") for k in MB_COLUMNS]
            + [fmt(s[a]["rss_mb_max"], ".0f")]
            for a, title in data["arms"].items()
        ]
        calls = sorted({v["first"]["broadcast_calls"] for a, v in s.items() if a in data["arms"] and v["first"]} - {0})
        targets = [[t["what"], t["procs"], *common.target_cells(t)] for t in s["targets"]]
        tables = [
            harness.markdown_table(COLUMNS, rows),
            harness.markdown_table(["target", "processes", "sharded / plain", "limit", "verdict"], targets),
        ]
        notes = [n.replace("{calls}", " or ".join(str(c) for c in calls) or "-") for n in NOTES]
        return self.page(data, INTRO, "sharded / plain", tables, notes)


if __name__ == "__main__":
    harness.main(Memory())
