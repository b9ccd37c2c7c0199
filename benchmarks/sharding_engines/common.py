"""What ``memory/`` and ``sharding_engines/`` share: workloads, options, issue 16's targets, the byte counts, the
summary and the page pieces (only the engine differs). See ``README.md``."""

from __future__ import annotations

import argparse
import itertools
import math
import resource
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks import harness
from benchmarks.harness import Panel, fmt
from benchmarks.harness import workloads as _workloads
from ds_lightning.sharding import optimizer_state_bytes

#: per workload, a full run's and --quick's steps, warm-up and batch
MODEL_DEFAULTS = {
    "digits": ({"steps": 40, "warmup": 5, "batch_size": 32}, {"steps": 5, "warmup": 2}),
    "gpt": ({"steps": 10, "warmup": 2, "batch_size": 8}, {"steps": 3, "warmup": 1}),
}
OPTIMIZERS = {"digits": "Adam (lr 1e-3)", "gpt": "AdamW (lr 3e-4, betas 0.9/0.95, no weight decay)"}
STATE_TARGETS = {2: 0.55, 4: 0.30}  # issue 16; other world sizes are reported without one
STEP_TARGET = 1.10
BYTES_TARGET = 1.1
PARITY_ATOL = 1e-5
HIDDEN = [1024, 1024]
#: ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` broadcasts one fp32 element for a rank owning nothing
DUMMY_BUCKET_BYTES = 4
BYTE_KEYS = ("allreduce_bytes", "broadcast_bytes", "allgather_bytes", "reducescatter_bytes")
#: the byte figures summarised in MB, each as ``<name>_mb...`` (``grad_bytes`` -> ``grad_mb``)
MB = ("state_bytes_max", "state_bytes_min", "grad_bytes", "broadcast_bytes_max", "sent_bytes_max", "ring_bytes_max")
MB += ("fsdp_bytes_max", *BYTE_KEYS)


def make_optimizer(model_name: str, params: Any) -> torch.optim.Optimizer:
    if model_name == "gpt":
        return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    return torch.optim.Adam(params, lr=1e-3)


def broadcast_bytes(partition: Sequence[Sequence[Mapping[str, Any]]], bucket_view: bool = False) -> list[int]:
    """Per rank (``partition``: ``_partition_parameters()``), the bytes it broadcasts as owner per step in
    ``ZeroRedundancyOptimizer._sync_params``: every owned parameter, or one bucket of the owned trainable ones."""
    sizes = [
        sum(p.numel() * p.element_size() for g in gs for p in g["params"] if p.requires_grad or not bucket_view)
        for gs in partition
    ]
    return [size or DUMMY_BUCKET_BYTES if bucket_view else size for size in sizes]


def broadcasts_per_step(partition: Sequence[Sequence[Mapping[str, Any]]], bucket_view: bool = False) -> int:
    """The ``broadcast`` calls every rank joins per step: one per parameter, or one bucket per rank."""
    return len(partition) if bucket_view else sum(len(g["params"]) for groups in partition for g in groups)


def padded_shard_bytes(shape: torch.Size, element_size: int, world: int) -> int:
    """One rank's FSDP2 shard of a parameter: dim 0 padded up to a multiple of ``world``, split evenly."""
    rows = math.ceil(shape[0] / world) if len(shape) else 1
    return rows * math.prod(shape[1:]) * element_size


def fsdp_bytes(params: list[torch.Tensor], world: int) -> tuple[int, int]:
    """This rank's FSDP2 ``(all-gather, reduce-scatter)`` bytes per step with ``reshard_after_forward=False``: its
    padded shard of every trainable parameter gathered once, every (padded) gradient scattered once."""
    shard = sum(padded_shard_bytes(p.shape, p.element_size(), world) for p in params if p.requires_grad)
    return shard, world * shard


def ring_bytes(rank: Mapping[str, Any], world: int) -> float:
    """What a rank sends per step if every collective ran as a ring (a lower bound; see ``README.md``)."""
    n = world
    return (
        2 * (n - 1) / n * rank["allreduce_bytes"]
        + rank["broadcast_bytes"]
        + (n - 1) * rank["allgather_bytes"]
        + (n - 1) / n * rank["reducescatter_bytes"]
    )


def reading_of(result: Mapping[str, Any]) -> dict[str, Any]:
    """One run's record from rank 0's ``result.json``: rank 0's median step, the per-rank and largest figures, and
    the payload parts of the rank that hands the most."""
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    state = [r["state_bytes"] for r in ranks]
    sent = [sum(r[k] for k in BYTE_KEYS) for r in ranks]
    rss = [r["peak_rss_mb"] for r in ranks]
    largest = ranks[max(range(len(ranks)), key=sent.__getitem__)]
    return {
        "step_ms": result["median_step_ms"],
        "parameters": result["parameters"],
        "optimizer_class": ranks[0]["optimizer_class"],
        "state_bytes_ranks": state,
        "state_bytes_max": max(state),
        "state_bytes_min": min(state),
        "sent_bytes_ranks": sent,
        "sent_bytes_max": max(sent),
        "ring_bytes_max": max(ring_bytes(r, len(ranks)) for r in ranks),
        **{k: largest[k] for k in BYTE_KEYS},
        "grad_bytes": ranks[0]["allreduce_bytes"],
        "broadcast_bytes_ranks": [r["broadcast_bytes"] for r in ranks],
        "broadcast_bytes_max": max(r["broadcast_bytes"] for r in ranks),
        "broadcast_calls": ranks[0].get("broadcast_calls", 0),
        "fsdp_bytes_max": max(r["allgather_bytes"] + r["reducescatter_bytes"] for r in ranks),
        "rss_mb_ranks": rss,
        "rss_mb_max": max(rss),
    }


def timed_steps(
    workload: _workloads.Workload, module: nn.Module, optimizer: Any, world: int, rank: int, batch: int, total: int
) -> list[float]:
    """Train ``total`` steps on this rank's share of the data (reshuffled each epoch); per step, the milliseconds of
    zero_grad, forward, backward and optimizer step (the span ``StepTimer`` takes in Lightning)."""
    sampler = DistributedSampler(workload.train_set, world, rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(workload.train_set, batch_size=batch, sampler=sampler, drop_last=True)
    step_ms: list[float] = []
    epoch = 0
    while len(step_ms) < total:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in itertools.islice(loader, total - len(step_ms)):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            workload.loss(module(x), y).backward()
            optimizer.step()
            step_ms.append((time.perf_counter() - start) * 1000)
    return step_ms


def rank_figures(rank: int, optimizer: Any, sent: Mapping[str, Any]) -> dict[str, Any]:
    """What each rank's worker reports: ``sent`` (its counted bytes), its optimizer state and peak RSS."""
    return {
        "rank": rank,
        "optimizer_class": type(optimizer).__name__,
        "state_bytes": optimizer_state_bytes(optimizer),
        **sent,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
    }


class ShardingBenchmark(harness.Benchmark):
    """What both drivers share: the workloads and options, the launch and reading, the summary and the chart."""

    models = ("digits", "gpt")
    worker: Path
    title: str
    summary_keys: Sequence[str]
    ratio_keys: Sequence[str]
    bytes_panel: Panel
    colors: Mapping[str, str]

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="process counts (2 4)")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        opts.hidden, opts.timeout = HIDDEN, 600.0
        _workloads.fill_defaults(opts, *({m: d[i] for m, d in MODEL_DEFAULTS.items()} for i in (0, 1)))
        workload = _workloads.spec_of(opts)
        return {"workload": workload, "workload_label": _workloads.label(workload, opts.hidden)}

    def spec(self, arm: harness.Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        keys = ("hidden", "batch_size", "steps", "warmup", "timeout")
        return {**arm.params, **{k: getattr(opts, k) for k in keys}, "workload": _workloads.spec_of(opts)}

    def run(self, arm: harness.Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        found, _, _ = harness.launch(self.worker, self.spec(arm, repeat, opts), opts.timeout, harness.worker_env(1))
        return {"rc": found["rc"], **reading_of(found["result"])}

    def progress(self, record: dict[str, Any]) -> str:
        return f"{record['step_ms']:.2f} ms/step, state {record['state_bytes_max'] / 1e6:.3f} MB"

    def spreads(self, data: dict[str, Any], pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
        """The spreads of :attr:`summary_keys` (byte figures in MB, derived here so ``--render`` needs nothing new),
        ``<key>_ratio`` of each ``(arm, base)`` per repeat, and per arm its ``first`` run (per-rank figures)."""
        records = [
            r if "error" in r else {**r, **{b.replace("_bytes", "_mb"): r[b] / 1e6 for b in MB if r.get(b) is not None}}
            for r in data["records"]
        ]
        s: dict[str, Any] = harness.summarise(records, list(data["arms"]), self.summary_keys)
        for arm, base in pairs:
            for key in self.ratio_keys if arm in s else ():
                s[arm][f"{key}_ratio"] = harness.paired(records, arm, base, key)
        for arm in data["arms"]:
            s[arm]["first"] = min(harness.ok(records, arm), key=lambda r: r["repeat"], default=None)
        return s

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        path = out / f"{harness.stem(self, data['settings'].get('model'))}.png"
        panels = [
            Panel("state_mb_max", "optimizer state, largest rank (MB)", "state_mb_max_ratio"),
            Panel("step_ms", "median step (ms)", "step_ms_ratio"),
            self.bytes_panel,
        ]
        title = f"{self.title} on the {data['workload_label']} (min-max over repeats)"
        colors = {a: self.colors[a.split("_")[0]] for a in data["arms"]}
        harness.bar_panels(path, {a: data["summary"][a] for a in data["arms"]}, panels, title, colors)
        return [path]

    def page(self, data: dict[str, Any], intro: str, ratio: str, tables: Sequence[list[str]], notes: Sequence[str]):
        """The results page: the set-up (``intro`` with ``{procs}``), then ``tables`` and ``notes``."""
        st = data["settings"]
        return [
            f"# {self.title} on the {data['workload_label']}",
            "",
            intro.format(procs=" and ".join(str(n) for n in st["procs"]))
            + setup_line(data)
            + f" Median [min - max] over repeats; each ratio is {ratio} of the same process count and repeat.",
            *(line for table in tables for line in ["", *table]),
            "",
            *notes,
            *failed(data),
        ]


def setup_line(data: dict[str, Any]) -> str:
    """The page's sentence on the optimizer, parameters, batch, steps and repeats."""
    s, st, workload = data["summary"], data["settings"], data["workload"]
    params = next((v["first"]["parameters"] for a, v in s.items() if a in data["arms"] and v["first"]), None)
    windows = f" windows of {workload.get('block_size')} tokens" if workload["model"] == "gpt" else ""
    return (
        f" {OPTIMIZERS.get(workload['model'], '?')}; {f'{params:,}' if params else '?'} parameters;"
        f" batch {st['batch_size']}{windows} per process;"
        f" {st['warmup']} warm-up + {st['steps']} timed steps per run; {st['repeats']} interleaved repeat(s)."
    )


def failed(data: dict[str, Any]) -> list[str]:
    """The failed runs of the page's arms, one line each."""
    errors = [f"{a}: {e}" for a in data["arms"] for e in data["summary"][a]["errors"]]
    return ["", "Failed runs:", *(f"- {f}" for f in errors)] if errors else []


def judged(arm: Mapping[str, Any], procs: int, checks: Sequence[tuple[str, str, float | None]]) -> list[dict[str, Any]]:
    """Per ``(what, key, limit)``: the arm's ``<key>_ratio`` and the harness's verdict on it (``-`` with no limit)."""
    out = []
    for what, key, limit in checks:
        ratio = arm.get(f"{key}_ratio")
        v = "-" if limit is None else harness.verdict(ratio, at_most=limit)
        out.append({"what": what, "procs": procs, "ratio": ratio, "limit": limit, "verdict": v})
    return out


def checks(n: int, prefix: str = "", payload: str = "payload handed to collectives") -> list[tuple[str, str, Any]]:
    """Issue 16's targets at ``n`` processes, as :func:`judged` takes them."""
    return [
        (f"{prefix}optimizer-state bytes, largest rank", "state_mb_max", STATE_TARGETS.get(n)),
        (f"{prefix}step time (rank 0's median)", "step_ms", STEP_TARGET),
        (f"{prefix}{payload}, largest rank", "sent_mb_max", BYTES_TARGET),
        (f"{prefix}payload bytes under a ring model, largest rank", "ring_mb_max", BYTES_TARGET),
    ]


def verdicts(targets: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The targets with a limit, as ``summary["verdicts"]`` lists them."""
    return [
        harness.judged(
            f"{t['engine'] + ': ' if 'engine' in t else ''}{t['what']}, {t['procs']} processes",
            t["ratio"],
            at_most=t["limit"],
            unit="x",
        )
        for t in targets
        if t["limit"] is not None
    ]


def rank_state(first: Mapping[str, Any] | None) -> str:
    """One run's optimizer state per rank in MB, ``rank 0 / 1 / ...``."""
    return " / ".join(f"{b / 1e6:.3f}" for b in (first or {}).get("state_bytes_ranks", [])) or "-"


def target_cells(t: Mapping[str, Any]) -> list[str]:
    limit, v = t["limit"], t["verdict"]
    return [fmt(t["ratio"], ".3f"), "-" if limit is None else f"<= {limit:.2f}x", f"**{v}**" if v != "-" else "-"]
