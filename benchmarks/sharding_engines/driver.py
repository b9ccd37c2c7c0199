"""Which engine should shard the optimizer state? DDP + ``ZeroRedundancyOptimizer`` and FSDP2, each against plain
DDP, in plain torch loops. Arms, targets and what a full run does: ``README.md``.

    python -m benchmarks.sharding_engines.driver [--quick] [--model digits|gpt] [--procs 2 4] ...
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
from benchmarks.harness import Arm, Experiment, Panel, fmt
from benchmarks.sharding_engines import common
from benchmarks.sharding_engines.common import PARITY_ATOL

ENGINES = ("ddp", "zero", "fsdp")
SHARDED = ("zero", "fsdp")
SUMMARY_KEYS = ["step_ms", "state_mb_max", "sent_mb_max", "ring_mb_max", "allreduce_mb", "broadcast_mb"]
SUMMARY_KEYS += ["allgather_mb", "reducescatter_mb", "rss_mb_max", "parity_max_abs"]
MB_COLUMNS = ("allreduce_mb", "broadcast_mb", "allgather_mb", "reducescatter_mb", "sent_mb_max", "ring_mb_max")
COLUMNS = ["arm", "optimizer state per rank (MB, rank 0 / 1 / ...)", "step (ms)", "all-reduce (MB)", "broadcast (MB)"]
COLUMNS += ["all-gather (MB)", "reduce-scatter (MB)", "payload handed (MB/step, largest rank)"]
COLUMNS += ["ring model (MB/step, largest rank)", "parity: max abs diff from ddp"]
INTRO = (
    "Plain torch training loops (no Lightning) on {procs} CPU processes (gloo, 1 thread each): `ddp`"
    " (DistributedDataParallel, the whole optimizer on every rank), `zero` (DistributedDataParallel and torch's"
    " `ZeroRedundancyOptimizer`, wrapped as `ds_lightning.sharding` wraps it) and `fsdp` (FSDP2"
    " `fully_shard(reshard_after_forward=False)` on every transformer block or linear layer, then on the root);"
)
QUICK = (
    "**A `--quick` smoke run** (1 repeat, a few steps): the bytes and the optimizer state are what a full run gives"
    " (they do not depend on the machine's load), the parity is after these few steps only, and the step times are"
    " not a measurement."
)
NOTES = [
    "- Optimizer state: every state tensor the rank's optimizer holds after the last step (FSDP2's DTensors by their"
    " local shard, ZeRO's for the parameters the rank owns).",
    "- Bytes are **counted from the collectives' payloads, not measured on a wire**, per rank per step (the columns:"
    " the largest rank's parts). 'Payload handed' sums the collectives' inputs, the 'ring model' what a ring sends;"
    " both are judged, the ring model compares wire traffic. How each is counted:"
    " [the README](../sharding_engines/README.md).",
    "- Parity: the final parameters (FSDP2's gathered) against the `ddp` run of the same repeat and process count, same"
    " seed and batches; the largest absolute difference over the repeats.",
]


def arm_name(engine: str, procs: int) -> str:
    return f"{engine}_p{procs}"


def parity(records: list[dict[str, Any]], params: Mapping[tuple[str, int], torch.Tensor]) -> None:
    """Each record's ``parity_max_abs``: the largest difference of its final parameters from the ``ddp`` run of the
    same repeat and process count (``None`` when either is missing)."""
    for r in records:
        if "error" in r:
            continue
        mine = params.get((r["arm"], r["repeat"]))
        base = params.get((arm_name("ddp", int(r["arm"].rsplit("_p", 1)[1])), r["repeat"]))
        missing = mine is None or base is None or mine.shape != base.shape
        r["parity_max_abs"] = None if missing else float((mine - base).abs().max())


def parity_verdict(summary: Mapping[str, Any], engine: str, n: int) -> dict[str, Any]:
    """Every run's final parameters within ``PARITY_ATOL`` of its ``ddp`` run's (the figure: per run, over repeats)."""
    diff = summary.get(arm_name(engine, n), {}).get("parity_max_abs")
    what = f"{engine}: final parameters, largest difference from ddp's, {n} processes"
    holds = diff["max"] <= PARITY_ATOL if diff else None
    return harness.judged(what, diff, at_most=PARITY_ATOL, spec="g", holds=holds)


class ShardingEngines(common.ShardingBenchmark):
    name = "sharding_engines"
    description = __doc__
    worker = Path(__file__).resolve().parent / "worker.py"
    title = "Sharding engines"
    summary_keys = SUMMARY_KEYS
    ratio_keys = ("step_ms", "state_mb_max", "sent_mb_max", "ring_mb_max")
    bytes_panel = Panel("ring_mb_max", "payload per step, ring model (MB, counted)", "ring_mb_max_ratio")
    colors = {"ddp": "tab:blue", "zero": "tab:orange", "fsdp": "tab:green"}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [Arm(arm_name(e, n), {"procs": n, "engine": e}, f"{e}, {n} procs") for n in opts.procs for e in ENGINES]
        return Experiment(arms, opts.repeats)

    def spec(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        path = Path(self._params_dir, f"{arm.name}_r{repeat}.pt")
        return {**super().spec(arm, repeat, opts), "params_path": str(path)}

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        # The final parameters stay on disk until every run is done: parity compares runs of the same repeat.
        with tempfile.TemporaryDirectory(prefix="ds-sharding-params-") as tmp:
            self._params_dir = tmp
            data = super().collect(opts)
            paths = {(r["arm"], r["repeat"]): Path(tmp, f"{r['arm']}_r{r['repeat']}.pt") for r in data["records"]}
            parity(data["records"], {k: torch.load(p) for k, p in paths.items() if p.exists()})
        return data

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        procs = data["settings"]["procs"]
        s = self.spreads(data, [(arm_name(e, n), arm_name("ddp", n)) for n in procs for e in SHARDED])
        s["targets"] = [
            {"engine": e, **t}
            for n in procs
            for e in SHARDED
            for t in common.judged(s.get(arm_name(e, n), {}), n, common.checks(n))
        ]
        parities = [parity_verdict(s, e, n) for n in procs for e in SHARDED]
        s["verdicts"] = [*common.verdicts(s["targets"]), *parities]
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, st = data["summary"], data["settings"]
        rows = []
        for arm, title in data["arms"].items():
            v, diff = s[arm], s[arm]["parity_max_abs"]
            parity_cell = "(reference)" if arm.startswith("ddp_") else "-" if diff is None else f"{diff['max']:.1e}"
            cells = [fmt(v["step_ms"], ".2f"), *(fmt(v[k], ".3f") for k in MB_COLUMNS), parity_cell]
            rows.append([title, common.rank_state(v["first"]), *cells])
        target_rows = [[t["engine"], t["what"], t["procs"], *common.target_cells(t)] for t in s["targets"]]
        tables = [
            *([[QUICK]] if st.get("quick") else []),
            harness.markdown_table(COLUMNS, rows),
            harness.markdown_table(["engine", "target", "processes", "engine / ddp", "limit", "verdict"], target_rows),
        ]
        return self.page(data, INTRO, "engine / `ddp`", tables, NOTES)


if __name__ == "__main__":
    harness.main(ShardingEngines())
