"""Part 4 of the cluster benchmark: ds_mirrored's two-level all-reduce against the flat ring, 2 hosts x 2 processes.
See README.md."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.cluster.launch import run_configs, shape_links
from benchmarks.cluster.report import WORKERS
from benchmarks.harness import Panel, bar_panels, fmt, round_order
from benchmarks.harness import workloads as _workloads
from ds_lightning.testing import netns

#: (name, hierarchical, gradient_compression)
CONFIGS = (
    ("flat", False, "none"),
    ("two_level", True, "none"),
    ("flat_fp16", False, "fp16"),
    ("two_level_fp16", True, "fp16"),
)
# Like for like; and the two-level path's own trade, fp16 between hosts only, against the uncompressed ring.
PAIRS = (("two_level", "flat"), ("two_level_fp16", "flat_fp16"), ("two_level_fp16", "flat"))
BYTES_TARGET = 0.55
SPEEDUP_TARGET = 1.5
PARITY_ATOL = 1e-5
DEVICES = 2
GPT_LR = 1e-3
GPT_BATCH = 8


def hierarchical_configs() -> list[dict[str, Any]]:
    return [{"name": n, "kind": "hierarchical", "hierarchical": h, "compression": c} for n, h, c in CONFIGS]


def hierarchical_spec(opts: argparse.Namespace, cluster: netns.Cluster, params_dir: str) -> dict[str, Any]:
    gpt = getattr(opts, "model", "digits") == "gpt"  # the GPT: part 1's AdamW and windows; the digits: SGD, 32
    spec = {"kind": "hierarchical", "workload": _workloads.spec_of(opts), "hidden": opts.hier_hidden, "seed": 0}
    spec |= {"lr": GPT_LR if gpt else 0.05, "batch_size": GPT_BATCH if gpt else 32, "val_windows": opts.val_windows}
    spec |= {"steps": opts.hier_steps, "warmup": opts.hier_warmup, "devices": DEVICES, "params_dir": params_dir}
    return spec | {"interface": cluster.hosts[0].interface, "dist_timeout": opts.dist_timeout}


def merge_hierarchical(ranks: dict[int, dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One run's reading: rank 0's median timed step, and the bytes both hosts' veths sent per timed step."""
    timed = ranks[0]["step_ms"][warmup:]
    sent = [r["tx_timed_bytes"] for r in ranks.values() if r["local_rank"] == 0]
    return {
        "step_ms": statistics.median(timed),
        "steps": len(timed),
        "inter_host_bytes_per_step": sum(sent) / len(timed) if timed and None not in sent else None,
        "hosts": len(sent),
        "param_checksum": ranks[0]["param_checksum"],
    }


def _same_compression(two_level: str, flat: str) -> bool:
    return two_level.replace("two_level", "flat") == flat


def run_hierarchical_round(
    cluster: netns.Cluster, r: int, opts: argparse.Namespace, raw: dict[str, list[dict[str, Any]]]
) -> None:
    """Every configuration once, one launch each (a Trainer of 2 devices starts its processes once per launch), the
    order rotating by repeat; the two-level runs' final parameters against the flat ring's of the same compression."""
    shape_links(cluster, {i: (opts.hier_rate, None) for i in range(WORKERS)})
    with tempfile.TemporaryDirectory(prefix="ds-hier-") as params_dir:
        spec = hierarchical_spec(opts, cluster, params_dir)
        done = {}
        for config in round_order(hierarchical_configs(), r):
            found = run_configs(cluster, spec, [config], opts)[config["name"]]
            reading = {"error": found["error"]} if "error" in found else merge_hierarchical(found, opts.hier_warmup)
            done[config["name"]] = reading | {"repeat": r}
        for two_level, flat in PAIRS:
            files = [Path(params_dir, f"{n}.pt") for n in (two_level, flat)]
            if _same_compression(two_level, flat) and all(f.exists() for f in files):
                one, two = (torch.load(f, weights_only=True) for f in files)
                done[two_level]["max_abs_diff_vs_flat"] = max(float((one[k] - two[k]).abs().max()) for k in one)
    for name, reading in done.items():
        raw[name].append(reading)
    shape_links(cluster, {})


def summarise_hierarchical(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per configuration; per-repeat paired ratios of each two-level run to the flat ring's."""
    ok = {n: [r for r in runs if "error" not in r] for n, runs in raw.items()}
    out: dict[str, Any] = {"configs": {}, "pairs": {}}
    for name, runs in ok.items():
        out["configs"][name] = {
            "step_ms": harness.spread([r["step_ms"] for r in runs]),
            "inter_host_bytes_per_step": harness.spread([r["inter_host_bytes_per_step"] for r in runs]),
            "failed": len(raw[name]) - len(runs),
        }
    for two_level, flat in PAIRS:
        by_repeat = {r["repeat"]: r for r in ok.get(flat, [])}
        pairs = [(r, by_repeat[r["repeat"]]) for r in ok.get(two_level, []) if r["repeat"] in by_repeat]
        key = "inter_host_bytes_per_step"
        same = _same_compression(two_level, flat)  # parity only where the gradients' values match
        diffs = [a["max_abs_diff_vs_flat"] for a, _ in pairs if same and "max_abs_diff_vs_flat" in a]
        reading = {
            "bytes_ratio": harness.spread([a[key] / b[key] for a, b in pairs if a[key] and b[key]]),
            "speedup": harness.spread([b["step_ms"] / a["step_ms"] for a, b in pairs]),
            "max_abs_diff": max(diffs) if diffs else None,
            "parity": harness.spread(diffs),  # per repeat: the largest difference of any final parameter
        }
        reading["bytes_met"] = harness.is_met(reading["bytes_ratio"], at_most=BYTES_TARGET)
        reading["speedup_met"] = harness.is_met(reading["speedup"], at_least=SPEEDUP_TARGET)
        # fp16 rounds other partial sums on each path: its difference is reported, not judged against fp32's.
        judged = two_level == "two_level"
        reading["parity_met"] = None if not diffs or not judged else max(diffs) <= PARITY_ATOL
        out["pairs"][f"{two_level}/{flat}"] = reading
    return out


def hierarchical_verdicts(summary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per pair: bytes, speed-up, and (uncompressed) the final parameters within fp32's tolerance in every repeat."""
    out = []
    for name, pair in ((summary or {}).get("pairs") or {}).items():
        out += [
            harness.judged(f"{name}: inter-host bytes per step", pair["bytes_ratio"], at_most=BYTES_TARGET, unit="x"),
            harness.judged(f"{name}: step-time speed-up", pair["speedup"], at_least=SPEEDUP_TARGET, unit="x"),
        ]
        if name == "two_level/flat":
            what = f"{name}: final parameters, largest difference"
            out.append(
                harness.judged(what, pair.get("parity"), at_most=PARITY_ATOL, spec="g", holds=pair["parity_met"])
            )
    return out


def hierarchical_markdown(summary: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    if settings.get("model") == "gpt":
        workload = _workloads.label(_workloads.spec_of(argparse.Namespace(**settings)))
        workload += f", AdamW lr {GPT_LR:g}, {GPT_BATCH} windows per process"
    else:
        workload = (
            f"{_workloads.label({'model': 'digits'}, settings['hier_hidden'])}, SGD lr 0.05, batch 32 per process"
        )
    rows = []
    for name, _, _ in CONFIGS:
        if (c := summary["configs"].get(name)) is not None:
            pair = next((v for k, v in summary["pairs"].items() if k.startswith(f"{name}/")), {})
            diff = pair.get("max_abs_diff")
            mb = fmt(c["inter_host_bytes_per_step"], ".2f", scale=1e-6)
            ratios = [fmt(pair.get("bytes_ratio"), ".3f"), fmt(pair.get("speedup"), ".3f")]
            rows.append([name, fmt(c["step_ms"]), mb, *ratios, "-" if diff is None else f"{diff:.1e}"])
    head = ["configuration", "step (ms)", "inter-host MB per step", "bytes vs flat", "speed-up vs flat", "max abs diff"]
    return [
        "",
        f"### Part 4: two-level all-reduce, 2 hosts x {DEVICES} processes, inter-host link {settings['hier_rate']:g}"
        f" Mbit/s ({workload})",
        "",
        "Inter-host bytes: both hosts' veth `tx_bytes` per timed step. Ratios per repeat against the flat ring of the"
        " same compression; max abs diff: the largest difference of any final parameter from that ring's (fp16's is"
        " not judged).",
        "",
        *harness.markdown_table(head, rows),
    ]


def plot_hierarchical(summary: dict[str, Any], path: Path) -> None:
    panels = [
        Panel("step_ms", "rank 0's median step (ms)"),
        Panel("inter_host_bytes_per_step", "inter-host bytes per step"),
    ]
    colors = {n: "tab:gray" if n.startswith("flat") else "tab:blue" for n, _, _ in CONFIGS}
    title = "Two-level all-reduce vs the flat ring: 2 hosts x 2 processes, shaped inter-host link"
    bar_panels(
        path, {n: summary["configs"][n] for n, _, _ in CONFIGS if n in summary["configs"]}, panels, title, colors
    )
