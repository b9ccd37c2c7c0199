"""The sharding-engines benchmark's markdown page (``driver.py``), from its summarised JSON."""

from __future__ import annotations

from typing import Any

from benchmarks import harness
from benchmarks.harness import fmt
from benchmarks.sharding_engines import common as _sharding_common
from benchmarks.sharding_engines.common import OPTIMIZERS

QUICK = (
    "**A `--quick` smoke run** (1 repeat, a few steps): the bytes and the optimizer state are what a full run gives"
    " (they do not depend on the machine's load), the parity is after these few steps only, and the step times are"
    " not a measurement."
)


def _parity(v: dict[str, Any] | None) -> str:
    """The largest difference over the repeats (``-`` for none)."""
    return "-" if v is None else f"{v['max']:.1e}"


def report(data: dict[str, Any]) -> list[str]:
    s, st = data["summary"], data["settings"]
    model = data.get("workload", {}).get("model", "digits")
    label = data.get("workload_label") or "digits MLP"
    rows = []
    for arm, title in data["arms"].items():
        v = s[arm]
        parity = "(reference)" if arm.startswith("ddp_") else _parity(v["parity_max_abs"])
        rows.append(
            [
                title,
                _sharding_common.per_rank_state(v["first"] or {}),
                fmt(v["step_ms"], ".2f"),
                fmt(v["allreduce_mb"], ".3f"),
                fmt(v["broadcast_mb"], ".3f"),
                fmt(v["allgather_mb"], ".3f"),
                fmt(v["reducescatter_mb"], ".3f"),
                fmt(v["sent_mb_max"], ".3f"),
                fmt(v["ring_mb_max"], ".3f"),
                parity,
            ]
        )
    target_rows = [[t["engine"], t["what"], t["procs"], *_sharding_common.target_cells(t)] for t in s["targets"]]
    return [
        f"# Sharding engines on the {label}",
        "",
        "Plain torch training loops (no Lightning) on"
        f" {' and '.join(str(n) for n in st['procs'])} CPU processes (gloo, 1 thread each):"
        " `ddp` (DistributedDataParallel, the whole optimizer on every rank), `zero` (DistributedDataParallel and"
        " torch's `ZeroRedundancyOptimizer`, wrapped as `ds_lightning.sharding` wraps it) and `fsdp` (FSDP2"
        " `fully_shard(reshard_after_forward=False)` on every transformer block or linear layer, then on the root);"
        f" {OPTIMIZERS.get(model, '?')}; {_sharding_common.parameters(data)} parameters;"
        f" batch {_sharding_common.batch(data)} per process;"
        f" {st['warmup']} warm-up + {st['steps']} timed steps per run; {st['repeats']} interleaved repeat(s)."
        " Median [min - max] over repeats; each ratio is engine / `ddp` of the same process count and repeat.",
        *(["", QUICK] if st.get("quick") else []),
        "",
        *harness.markdown_table(
            [
                "arm",
                "optimizer state per rank (MB, rank 0 / 1 / ...)",
                "step (ms)",
                "all-reduce (MB)",
                "broadcast (MB)",
                "all-gather (MB)",
                "reduce-scatter (MB)",
                "payload handed (MB/step, largest rank)",
                "ring model (MB/step, largest rank)",
                "parity: max abs diff from ddp",
            ],
            rows,
        ),
        "",
        *harness.markdown_table(["engine", "target", "processes", "engine / ddp", "limit", "verdict"], target_rows),
        "",
        "- Optimizer state: every state tensor the rank's optimizer holds after the last step (FSDP2's are DTensors:"
        " their local shard is counted; ZeRO's are the wrapped optimizer's, for the parameters the rank owns).",
        "- Bytes are **counted from the collectives' payloads, not measured on a wire**, per rank per step (the"
        " columns are the largest rank's parts). `ddp` and `zero`: the gradient all-reduce's payload (every trainable"
        " gradient) plus, `zero`, the parameters the rank broadcasts as their owner after its step. `fsdp`: the"
        " all-gather input (the rank's shard of every parameter, dim 0 padded to a multiple of N, once per step: with"
        " `reshard_after_forward=False` the forward's all-gather serves the backward) plus the reduce-scatter input"
        " (every gradient whole, padded). 'Payload handed' sums the inputs as given; the 'ring model' counts what a"
        " ring algorithm sends: 2(N-1)/N of an all-reduce, (N-1) shards of an all-gather, (N-1)/N of a"
        " reduce-scatter, and a broadcast's payload once from its owner (a lower bound for `zero`). The bytes"
        " targets are judged on both; the ring model is the one that compares wire traffic.",
        "- Parity: the final parameters (whole; FSDP2's gathered) against the `ddp` run of the same repeat and process"
        " count, same seed and same batches; the largest absolute difference over the repeats.",
        *_sharding_common.failed(data),
    ]
