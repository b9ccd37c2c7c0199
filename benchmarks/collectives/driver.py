"""What do gloo's reduce-scatter and all-gather cost against its all-reduce, on CPU over loopback? Arms and what a
full run does: ``README.md``.

    python -m benchmarks.collectives.driver [--quick] [--procs 2 4] [--sizes digits 10M] [--iters 10] [--warmup 2]
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
#: fp32 elements: the two workloads' parameter counts (``gpt`` is off by default: no figure in the docs reads it),
#: and one larger
SIZES = {
    "digits": sum(p.numel() for p in make_mlp(64, [1024, 1024], 10).parameters()),
    "gpt": sum(p.numel() for p in GPT(**_workloads.GPT_DEFAULTS).parameters()),
    "10M": 10_000_000,
}
SIZE_LABELS = {"digits": "digits MLP", "gpt": "GPT", "10M": "10M"}
RATIOS = {"reduce_scatter": "rs_over_ar", "all_gather": "ag_over_ar", "rs_ag": "rsag_over_ar"}
EXTRA = "rsag_extra_ms"  # RS + AG - AR of a run: what FSDP2's pair costs beyond DDP's all-reduce
KEYS = [*(f"{op}_ms" for op in OPS), *RATIOS.values(), EXTRA, *(f"{op}_mbps" for op in OPS)]


def size_of(name: str) -> int:
    if name in SIZES:
        return SIZES[name]
    if not name.isdigit() or int(name) < 1:
        raise SystemExit(f"--sizes {name}: give one of {list(SIZES)} or a positive number of elements")
    return int(name)


def arm_name(size: str, procs: int) -> str:
    return f"{size}_p{procs}"


def ring_bytes(op: str, numel: int, world: int) -> float:
    """What one rank sends for ``op`` as a ring: (N-1)/N of the tensor for a reduce-scatter or an all-gather, twice
    that for an all-reduce or the pair."""
    return (world - 1) / world * 4 * numel * (2 if op in ("all_reduce", "rs_ag") else 1)


def reading_of(result: Mapping[str, Any]) -> dict[str, Any]:
    """Per op the median over rounds of the slowest rank's ms, the ring-model MB/s it makes, and op / all_reduce."""
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


def meaning(s: Mapping[str, Any], arms: list[str]) -> str:
    """The page's conclusion for ``sharding_engine="fsdp2"`` on gloo, from every size's and N's medians."""
    arms = [a for a in arms if all(s[a].get(k) for k in RATIOS.values())]
    if not arms:
        return "No run succeeded: nothing to conclude."

    def span(key: str) -> str:
        lo, hi = (f(s[a][key]["median"] for a in arms) for f in (min, max))
        return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}x to {hi:.2f}x"

    pair = [s[a]["rsag_over_ar"]["median"] for a in arms]
    head = (
        f"Over every size and process count measured, gloo's reduce-scatter takes {span('rs_over_ar')}"
        f" its all-reduce's time (ring model: 0.50x), its all-gather {span('ag_over_ar')} (ring model:"
        f" 0.50x), and FSDP2's pair {span('rsag_over_ar')} (ring model: 1.00x)."
    )
    if min(pair) > 1.1:
        return head + (
            ' So on gloo CPU, `sharding_engine="fsdp2"` waits longer on its collectives than DDP waits on the'
            " all-reduce of the same gradients, although under a ring model they send the same bytes: fsdp2 pays for"
            " how gloo runs reduce-scatter and all-gather, not for extra traffic. The column RS + AG - AR is that"
            " cost per step for one tensor of the model's size, before any overlap with compute; set against the"
            " fsdp2 step's excess over plain's in [memory.md](memory.md), it says how much of fsdp2's missed"
            ' step-time target the collectives alone account for. On gloo, `sharding_engine="zero"` (the default)'
            " stays the faster choice; fsdp2's case rests on a backend whose reduce-scatter costs what the ring"
            " model says (not measured here)."
        )
    if max(pair) <= 1.1:
        return head + (
            " Here FSDP2's pair costs no more than the all-reduce it replaces, so the collectives alone do not"
            " explain fsdp2's slower steps on gloo CPU."
        )
    return head + " At some sizes and process counts only: the collectives explain part of fsdp2's slower steps."


COLUMNS = ["tensor, procs", "fp32 elements", "all_reduce (ms)", "reduce_scatter (ms)", "all_gather (ms)"]
COLUMNS += [
    "RS + AG (ms)",
    "RS / AR (ring 0.5)",
    "AG / AR (ring 0.5)",
    "(RS + AG) / AR (ring 1.0)",
    "RS + AG - AR (ms)",
]
RING_COLUMNS = ["tensor, procs", "ring MB per rank: AR / RS / AG / RS + AG", "AR (MB/s)", "RS (MB/s)", "AG (MB/s)"]
RING_COLUMNS += ["RS + AG (MB/s)"]


class Collectives(harness.Benchmark):
    name = "collectives"
    description = __doc__
    defaults = {"repeats": 3, "iters": 10, "warmup": 2}
    quick = {"repeats": 1, "iters": 3, "warmup": 1}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="process counts (2 4)")
        parser.add_argument("--sizes", nargs="+", default=["digits", "10M"], help=f"{', '.join(SIZES)} or a number")
        parser.add_argument("--iters", type=int, default=None, help="timed rounds per run (10; --quick: 3)")
        parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds left out (2; --quick: 1)")

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
        spec = {**arm.params, "iters": opts.iters, "warmup": opts.warmup, "timeout": 300}
        found, _, _ = harness.launch(WORKER, spec, 300, harness.worker_env(1))
        return {"rc": found["rc"], **reading_of(found["result"])}

    def progress(self, record: dict[str, Any]) -> str:
        return f"AR {record['all_reduce_ms']:.2f} ms, RS+AG / AR {record['rsag_over_ar']:.2f}"

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        s: dict[str, Any] = harness.summarise(data["records"], list(data["arms"]), KEYS)
        st = data["settings"]
        for n, size in ((n, size) for n in st["procs"] for size in st["sizes"] if arm_name(size, n) in s):
            s[arm_name(size, n)].update(size=size, procs=n, numel=padded(size_of(size), n))
        s["verdicts"] = []  # no target: the ring model's ratios are the reference (README)
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, st = data["summary"], data["settings"]
        rows, ring_rows = [], []
        for arm, title in data["arms"].items():
            v = s[arm]
            times = [fmt(v[f"{op}_ms"], ".2f") for op in OPS]
            ratios = [fmt(v[k], ".2f") for k in [*RATIOS.values(), EXTRA]]
            rows.append([title, f"{v.get('numel'):,}", *times, *ratios])
            ring = " / ".join(f"{ring_bytes(op, v.get('numel'), v.get('procs')) / 1e6:.2f}" for op in OPS)
            ring_rows.append([title, ring, *(fmt(v[f"{op}_mbps"], ".0f") for op in OPS)])
        failed = [f"- {a}: {e}" for a in data["arms"] for e in s[a]["errors"]]
        quick = ["", "**A `--quick` smoke run** (1 repeat, few rounds): the times are not a measurement."]
        return [
            "# Gloo collectives: reduce-scatter and all-gather against all-reduce",
            "",
            f"`benchmarks/collectives` ([how it measures](../collectives/README.md)):"
            f" {' and '.join(str(n) for n in st['procs'])} CPU processes on gloo"
            f" over loopback, 1 thread each, torch {data.get('torch', '?')}, {data.get('cpus', '?')} CPU cores;"
            f" {st['warmup']} warm-up + {st['iters']} timed rounds per run, a call's time the slowest rank's, a run's"
            f" the median over its rounds; {st['repeats']} interleaved repeat(s); median [min - max] over repeats;"
            " ratios are op / `all_reduce` of the same run, where a ring model says RS / AR = AG / AR = 0.5 and"
            " (RS + AG) / AR = 1.0.",
            *(quick if st["quick"] else []),
            "",
            *harness.markdown_table(COLUMNS, rows),
            "",
            "Ring-model bytes each rank sends, and the rate the measured time makes of them:",
            "",
            *harness.markdown_table(RING_COLUMNS, ring_rows),
            "",
            '## What this means for `sharding_engine="fsdp2"`',
            "",
            meaning(s, list(data["arms"])),
            "",
            "FSDP2 issues one reduce-scatter and one all-gather per sharded unit (the MLP's 3 linear layers; the GPT's"
            " embedding, blocks, norm and head), so its messages are smaller than the one tensor timed here, and it can"
            " overlap them with compute; this page times the collectives alone.",
            *(["", "Failed runs:", *failed] if failed else []),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        panels = [
            Panel("all_reduce_ms", "all_reduce (ms)", log=True),
            Panel("rs_over_ar", "reduce_scatter / all_reduce (ring 0.5)"),
            Panel("rsag_over_ar", "(reduce_scatter + all_gather) / all_reduce (ring 1.0)"),
        ]
        title = "gloo collectives on CPU, per size and process count (min-max over repeats)"
        harness.bar_panels(out / f"{self.name}.png", {a: data["summary"][a] for a in data["arms"]}, panels, title)
        return [out / f"{self.name}.png"]


if __name__ == "__main__":
    harness.main(Collectives())
