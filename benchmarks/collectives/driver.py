"""What do gloo's reduce-scatter and all-gather cost against its all-reduce, on CPU over loopback?

``MirroredStrategy(sharding_engine="fsdp2")`` replaces DDP's all-reduce of the gradients with FSDP2's reduce-scatter
(backward) and all-gather (before the next forward): the same bytes per rank under a ring model, yet its steps ran
1.70x / 2.31x plain DDP's at 2 / 4 ranks (``results/memory.md``). This times the collectives alone, with no model:
N processes (``--procs``, 2 and 4; gloo over loopback, 1 thread each, a free port per run) time ``all_reduce``,
``reduce_scatter_tensor``, ``all_gather_into_tensor`` and the two back to back (``rs_ag``, FSDP2's pair per step) on
one fp32 tensor of each size (``--sizes``: the digits MLP's 1,126,410 parameters, the default GPT's 875,520, and
10M). One run is one launch of one (size, N): the ops interleaved round by round, a barrier before each timed call,
the median over the rounds of the slowest rank's time; the harness interleaves the runs and repeats them. Each ratio
(op / all_reduce) is taken within a run, then summarised over the repeats.

    python -m benchmarks.collectives.driver [--quick] [--repeats 3] [--out DIR] [--render [JSON]]
        [--procs 2 4] [--sizes digits gpt 10M] [--iters 20] [--warmup 3] [--timeout 300]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.collectives.worker import OPS, padded
from benchmarks.harness import Arm, Experiment, Panel, fmt
from benchmarks.harness import workloads as _workloads
from ds_lightning.demos import GPT, make_mlp

WORKER = Path(__file__).resolve().parent / "worker.py"


def _parameters(net: torch.nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


#: the named sizes (fp32 elements): the parameter counts of the benchmarks' two default workloads
#: (``harness/workloads.py``), and one larger
SIZES = {
    "digits": _parameters(make_mlp(64, [1024, 1024], 10)),
    "gpt": _parameters(GPT(**_workloads.GPT_DEFAULTS)),
    "10M": 10_000_000,
}
SIZE_LABELS = {"digits": "digits MLP", "gpt": "GPT", "10M": "10M"}
#: op / all_reduce under a ring model (bytes sent per rank), whatever N
RING_RATIO = {"all_reduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5, "rs_ag": 1.0}
RATIOS = {"reduce_scatter": "rs_over_ar", "all_gather": "ag_over_ar", "rs_ag": "rsag_over_ar"}
EXTRA = "rsag_extra_ms"  # RS + AG - AR of a run: what FSDP2's pair costs beyond DDP's all-reduce
KEYS = [*(f"{op}_ms" for op in OPS), *RATIOS.values(), EXTRA, *(f"{op}_mbps" for op in OPS)]


def size_of(name: str) -> int:
    """A size's fp32 elements: a name of :data:`SIZES`, or a positive integer."""
    if name in SIZES:
        return SIZES[name]
    if not name.isdigit() or int(name) < 1:
        raise SystemExit(f"--sizes {name}: give one of {list(SIZES)} or a positive number of elements")
    return int(name)


def arm_name(size: str, procs: int) -> str:
    return f"{size}_p{procs}"


def ring_bytes(op: str, numel: int, world: int) -> float:
    """Bytes one rank sends for ``op`` on ``numel`` fp32 elements if it ran as a ring: an all-reduce 2(N-1)/N of the
    tensor, a reduce-scatter or an all-gather (N-1)/N of it, the pair 2(N-1)/N."""
    per_half = (world - 1) / world * 4 * numel
    return per_half * (2 if op in ("all_reduce", "rs_ag") else 1)


def reading_of(result: Mapping[str, Any]) -> dict[str, Any]:
    """One run's record: per op the median over rounds of the slowest rank's ms, the ring-model MB/s that makes,
    and each op / all_reduce of this run."""
    world, numel = result["procs"], result["numel"]
    ms = {op: statistics.median(result["ms"][op]) for op in OPS}
    out: dict[str, Any] = {"procs": world, "numel": numel, "threads": result.get("threads")}
    for op in OPS:
        out[f"{op}_ms"] = ms[op]
        out[f"{op}_mbps"] = ring_bytes(op, numel, world) / 1e6 / (ms[op] / 1000) if ms[op] > 0 else None
    for op, key in RATIOS.items():
        out[key] = ms[op] / ms["all_reduce"] if ms["all_reduce"] > 0 else None
    out[EXTRA] = ms["rs_ag"] - ms["all_reduce"]
    return out


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    """The harness's spreads of :data:`KEYS` per arm, and each arm's size, N and padded elements."""
    s: dict[str, Any] = harness.summarise(data["records"], list(data["arms"]), KEYS)
    for n in data["settings"]["procs"]:
        for size in data["settings"]["sizes"]:
            arm = arm_name(size, n)
            if arm in s:
                s[arm].update(size=size, procs=n, numel=padded(size_of(size), n))
    s["verdicts"] = []  # no target: the ring model's ratios are the reference (README)
    return s


def _range(s: Mapping[str, Any], arms: list[str], key: str) -> str:
    medians = [s[a][key]["median"] for a in arms if s[a].get(key)]
    if not medians:
        return "?"
    lo, hi = min(medians), max(medians)
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}x to {hi:.2f}x"


def meaning(data: dict[str, Any]) -> list[str]:
    """The page's conclusion for ``sharding_engine="fsdp2"`` on gloo, from the medians of every size and N."""
    s = data["summary"]
    arms = [a for a in data["arms"] if s[a].get("rsag_over_ar")]
    if not arms:
        return ["No run succeeded: nothing to conclude."]
    pair = [s[a]["rsag_over_ar"]["median"] for a in arms]
    head = (
        f"Over every size and process count measured, gloo's reduce-scatter takes {_range(s, arms, 'rs_over_ar')}"
        f" its all-reduce's time (ring model: 0.50x), its all-gather {_range(s, arms, 'ag_over_ar')} (ring model:"
        f" 0.50x), and FSDP2's pair {_range(s, arms, 'rsag_over_ar')} (ring model: 1.00x)."
    )
    if min(pair) > 1.1:
        tail = (
            ' So on gloo CPU, `sharding_engine="fsdp2"` waits longer on its collectives than DDP waits on the'
            " all-reduce of the same gradients, although under a ring model they send the same bytes: fsdp2 pays for"
            " how gloo runs reduce-scatter and all-gather, not for extra traffic. The column RS + AG - AR is that"
            " cost per step for one tensor of the model's size, before any overlap with compute; set against the"
            " fsdp2 step's excess over plain's in [memory.md](memory.md), it says how much of fsdp2's missed"
            ' step-time target the collectives alone account for. On gloo, `sharding_engine="zero"` (the default)'
            " stays the faster choice; fsdp2's case rests on a backend whose reduce-scatter costs what the ring"
            " model says (not measured here)."
        )
    elif max(pair) <= 1.1:
        tail = (
            " Here FSDP2's pair costs no more than the all-reduce it replaces, so the collectives alone do not"
            " explain fsdp2's slower steps on gloo CPU; the time goes elsewhere (the per-unit calls, the"
            " DTensor bookkeeping)."
        )
    else:
        tail = (
            " FSDP2's pair costs more than the all-reduce at some sizes and process counts and not at others (see"
            " the table): on gloo CPU, the collectives explain part of fsdp2's slower steps."
        )
    return [head + tail]


def report(data: dict[str, Any]) -> list[str]:
    """The markdown page: the times and ratios, the ring-model bytes and throughput, and what it means."""
    s, st = data["summary"], data["settings"]
    rows, ring_rows = [], []
    for arm, title in data["arms"].items():
        v = s[arm]
        numel, n = v.get("numel"), v.get("procs")
        rows.append(
            [
                title,
                f"{numel:,}" if numel else "-",
                *(fmt(v[f"{op}_ms"], ".2f") for op in OPS),
                *(fmt(v[key], ".2f") for key in RATIOS.values()),
                fmt(v[EXTRA], ".2f"),
            ]
        )
        ring = " / ".join(f"{ring_bytes(op, numel, n) / 1e6:.2f}" for op in OPS) if numel and n else "-"
        ring_rows.append([title, ring, *(fmt(v[f"{op}_mbps"], ".0f") for op in OPS)])
    failed = [f"{a}: {e}" for a in data["arms"] for e in s[a]["errors"]]
    quick = (
        "**A `--quick` smoke run** (1 repeat, few rounds): the times are not a measurement." if st.get("quick") else ""
    )
    return [
        "# Gloo collectives: reduce-scatter and all-gather against all-reduce",
        "",
        f"`benchmarks/collectives`: {' and '.join(str(n) for n in st['procs'])} CPU processes on gloo over loopback,"
        f" 1 thread each, torch {data.get('torch', '?')}, {data.get('cpus', '?')} CPU cores; one fp32 tensor per"
        " size, padded to a multiple of N. Each run times `all_reduce`, `reduce_scatter_tensor` (whole tensor in,"
        " a 1/N shard out), `all_gather_into_tensor` (the shard in, the whole tensor out) and RS + AG back to back"
        f" (FSDP2's pair per step), interleaved over {st['warmup']} warm-up + {st['iters']} timed rounds, a barrier"
        " before each call; a call's time is the slowest rank's, a run's the median over the rounds."
        f" {st['repeats']} interleaved repeat(s); median [min - max] over repeats; ratios are op / `all_reduce` of"
        " the same run. Under a ring model every rank sends 2(N-1)/N of the tensor for an all-reduce, (N-1)/N for a"
        " reduce-scatter or an all-gather: RS / AR = AG / AR = 0.5 and (RS + AG) / AR = 1.0.",
        *(["", quick] if quick else []),
        "",
        *harness.markdown_table(
            [
                "tensor, procs",
                "fp32 elements",
                "all_reduce (ms)",
                "reduce_scatter (ms)",
                "all_gather (ms)",
                "RS + AG (ms)",
                "RS / AR (ring 0.5)",
                "AG / AR (ring 0.5)",
                "(RS + AG) / AR (ring 1.0)",
                "RS + AG - AR (ms)",
            ],
            rows,
        ),
        "",
        "Ring-model bytes each rank sends, and the rate the measured time makes of them:",
        "",
        *harness.markdown_table(
            [
                "tensor, procs",
                "ring MB per rank: AR / RS / AG / RS + AG",
                "AR (MB/s)",
                "RS (MB/s)",
                "AG (MB/s)",
                "RS + AG (MB/s)",
            ],
            ring_rows,
        ),
        "",
        '## What this means for `sharding_engine="fsdp2"`',
        "",
        *meaning(data),
        "",
        "FSDP2 issues one reduce-scatter and one all-gather per sharded unit (the MLP's 3 linear layers; the GPT's"
        " embedding, blocks, norm and head), so its messages are smaller than the one tensor timed here, and it can"
        " overlap them with compute; this page times the collectives alone.",
        *(["", "Failed runs:", *(f"- {f}" for f in failed)] if failed else []),
    ]


class Collectives(harness.Benchmark):
    name = "collectives"
    description = __doc__
    defaults = {"repeats": 3, "iters": 20, "warmup": 3}
    quick = {"repeats": 1, "iters": 3, "warmup": 1}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="process counts (2 4)")
        parser.add_argument(
            "--sizes", nargs="+", default=list(SIZES), help=f"tensor sizes: {', '.join(SIZES)} or a number of elements"
        )
        parser.add_argument("--iters", type=int, default=None, help="timed rounds per run (20; --quick: 3)")
        parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds left out (3; --quick: 1)")
        parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take (300)")

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        for name in opts.sizes:
            size_of(name)  # an unknown name fails before anything runs
        return {"torch": torch.__version__, "cpus": torch.multiprocessing.cpu_count(), "machine": platform.machine()}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [
            Arm(arm_name(size, n), {"procs": n, "numel": size_of(size)}, f"{SIZE_LABELS.get(size, size)}, {n} procs")
            for n in opts.procs
            for size in opts.sizes
        ]
        return Experiment(arms, opts.repeats)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {**arm.params, "iters": opts.iters, "warmup": opts.warmup, "timeout": opts.timeout}
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1))
        return {"rc": found["rc"], **reading_of(found["result"])}

    def progress(self, record: dict[str, Any]) -> str:
        return (
            f"AR {record['all_reduce_ms']:.2f} ms, RS {record['reduce_scatter_ms']:.2f} ms,"
            f" AG {record['all_gather_ms']:.2f} ms, RS+AG / AR {record['rsag_over_ar']:.2f}"
        )

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        return summarise(data)

    def report(self, data: dict[str, Any]) -> list[str]:
        return report(data)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        path = out / f"{self.name}.png"
        s = data["summary"]
        harness.bar_panels(
            path,
            {a: s[a] for a in data["arms"]},
            [
                Panel("all_reduce_ms", "all_reduce (ms)", log=True),
                Panel("rs_over_ar", "reduce_scatter / all_reduce (ring 0.5)"),
                Panel("rsag_over_ar", "(reduce_scatter + all_gather) / all_reduce (ring 1.0)"),
            ],
            title="gloo collectives on CPU, per size and process count (min-max over repeats)",
        )
        return [path]


if __name__ == "__main__":
    harness.main(Collectives())
