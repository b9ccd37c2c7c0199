"""The cluster benchmark's constants and its page (tables and chart) from the flat view of a finished run
(``Cluster.view``), so ``--render`` needs no cluster. The method is in README.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness import Panel, bar_panels, fmt, markdown_table
from benchmarks.harness import workloads as _workloads
from benchmarks.mirrored.auto import AUTO, CLUSTER_TARGET, choice_text

WORKERS = 2
BATCH = 32
LR = 0.05
GPT_LR = 1e-3  # AdamW, betas (0.9, 0.95), weight decay 0.1: learns the bytes within a few hundred steps
TARGET_SPEEDUP = 5.0  # best compression vs none at 100 Mbit/s
ACC_TOLERANCE_POINTS = 1.0  # "equal accuracy": validation accuracy after the long run, in points
PPL_TOLERANCE = 0.02  # "equal perplexity": within 2% of none's (relative), after the same tokens
NO_NETEM = "not measured: this kernel has no netem"
# Part 1's links, both workers' shaped alike; the delays need netem, which this machine's kernel lacks.
LINKS: list[dict[str, Any]] = [
    {"key": "1gbit", "label": "1 Gbit/s", "rate_mbit": 1000.0, "delay_ms": None},
    {"key": "100mbit", "label": "100 Mbit/s", "rate_mbit": 100.0, "delay_ms": None},
    {"key": "1gbit_1ms", "label": "1 Gbit/s + 1 ms delay", "rate_mbit": 1000.0, "delay_ms": 1.0},
    {"key": "100mbit_1ms", "label": "100 Mbit/s + 1 ms delay", "rate_mbit": 100.0, "delay_ms": 1.0},
]
LABELS = {link["key"]: link["label"] for link in LINKS}
TARGET_LINK = "100mbit"
GPT_LINKS = ("1gbit", "100mbit")
UNEVEN_MBIT = (1000.0, 100.0)  # parts 2 and 3: worker 0's link 10x faster than worker 1's
MIRRORED, EQUAL, BALANCED = "ds_mirrored", "equal", "balanced"
README = "../cluster/README.md"  # from a results page


def links_of(model: str | None) -> list[dict[str, Any]]:
    return [link for link in LINKS if model != "gpt" or link["key"] in GPT_LINKS]


def measured_links(data: dict[str, Any]) -> list[dict[str, Any]]:
    comp = data.get("compression") or {}
    return [link for link in LINKS if link["key"] in comp and link["key"] not in data["setup"]["unsupported"]]


def title(data: dict[str, Any]) -> str:
    small = f"64-{'-'.join(str(h) for h in data['ps_hidden'])}-10"  # parts 2 and 3 always train the digits
    if data.get("model") == "gpt":
        label = data.get("workload_label") or _workloads.label(data.get("workload") or {"model": "gpt"})
        rest = f" (parts 2 and 3: digits MLP {small})" if {"ps", "balance"} & set(data["parts"]) else ""
        return f"# Network-namespace cluster on the {label}{rest}"
    big = _workloads.label({"model": "digits"}, data["hidden"])
    return f"# Network-namespace cluster on the {big} (parts 2 and 3: {small})"


def _or(x: float | None, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def _failed(v: dict[str, Any], of_runs: bool = False) -> str:
    if not v["failed_runs"]:
        return ""
    return f" ({v['failed_runs']} of {v['runs']} failed)" if of_runs else f" ({v['failed_runs']} failed)"


def setup_line(data: dict[str, Any]) -> str:
    setup = data["setup"]
    probes = ", ".join(f"{k}: {v:.0f} Mbit/s" if v else f"{k}: failed" for k, v in setup.get("probes", {}).items())
    return (
        f"**Setup.** 3 network-namespace hosts, qdisc {setup.get('qdisc_kind', '?')}; measured TCP throughput host 1"
        f" -> host 0: {probes or 'not probed'}. {data['repeats']} interleaved repeat(s); median [min - max] over"
        f" repeats, ratios per repeat. Total time {data['seconds'] / 60:.1f} min on a shared 2-core machine. Method:"
        f" [README]({README})."
    )


def part1_lines(data: dict[str, Any]) -> list[str]:
    """Per setting and link: step time, speed-up (the GPT's tokens/s too), the long run's accuracy or perplexity."""
    gpt = data.get("model") == "gpt"
    comp, acc, t = data["compression"], data.get("accuracy") or {}, data["targets"][0]
    links, unsupported = measured_links(data), data["setup"]["unsupported"]
    tokens = WORKERS * data["batch_size"] * data["gpt_block"] if gpt else 0
    head = ["gradient_compression", "MB/step (timed)"]
    for link in links:
        head += [f"{link['label']}: {x}" for x in ("step (ms)", *["tokens/s"] * gpt, "speedup")]
    after = f"val perplexity after {tokens * data['acc_steps']:,} tokens" if gpt else "val acc after"
    head += ["unshaped step (ms), 1 run", after if gpt else f"{after} {data['acc_steps']} steps (%)", "vs none"]
    base = acc.get("none", {}).get("final_acc")
    rows = []
    for name in [c["name"] for c in data["compression_configs"] if c["compression"] != AUTO]:
        mb = next((comp[k][name]["bytes_per_step"] for k in comp if comp[k].get(name, {}).get("bytes_per_step")), None)
        row = [name, "-" if mb is None else f"{mb['median'] / 1e6:.3f}"]
        for link in links:
            v = comp[link["key"]].get(name)
            if v is None or v["step_ms"] is None:
                row += [f"failed ({v['failed_runs']} of {v['runs']})" if v else "-"] + ["-"] * (1 + gpt)
                continue
            row += [f"{fmt(v['step_ms'], '.0f')}{_failed(v, True)}", *[fmt(v.get("tokens_per_s"), ".0f")] * gpt]
            row.append("1" if name == "none" else f"**{fmt(v['speedup_over_none'], '.2f')}x**")
        a = acc.get(name, {})
        row.append(f"{a['median_step_ms']:.0f}" if "median_step_ms" in a else "failed")
        if gpt:
            ratio = t.get("ppl_ratio", {}).get(name)
            row += [f"{a['final_ppl']:.3f}" if "final_ppl" in a else "failed", _or(ratio, ".4f", "x")]
        else:
            points = None if base is None or "final_acc" not in a else 100 * (a["final_acc"] - base)
            row += [f"{100 * a['final_acc']:.1f}" if "final_acc" in a else "failed", _or(points, "+.1f", " points")]
        rows.append(row)
    params = "?" if data.get("params") is None else f"{data['params'] / 1e6:.2f}M"
    lines = [
        f"**1. ds_mirrored gradient_compression on shaped links** ({data.get('workload_label')}, {params} parameters;"
        f" {data['warmup']} warm-up + {data['steps']} timed steps per run; {'perplexity' if gpt else 'accuracy'} after"
        f" {data['acc_steps']} steps on the unshaped link; powersgd_start_iter={data['powersgd_start_iter']}).",
        "",
        *markdown_table(head, rows),
        "",
    ]
    if unsupported:
        lines += [f"{', '.join(LABELS[k] for k in unsupported)}: {NO_NETEM}.", ""]
    for name, x in t.get("excluded_for_ppl_ratio" if gpt else "excluded_for_accuracy_points", {}).items():
        if x is None:
            why = f"its {'perplexity' if gpt else 'accuracy'} run failed"
        else:
            why = f"its perplexity is {x:.4f}x none's" if gpt else f"{x:+.1f} points vs none after the same steps"
        lines += [
            f"{name} is left out of the 5x verdict: {why}{f' (limit {1 + PPL_TOLERANCE:g}x)' if gpt else ''}.",
            "",
        ]
    if gpt:
        pct = f"{100 * PPL_TOLERANCE:g}%"
        tried, rank = ", ".join(str(r) for r in t["powersgd_ranks"]) or "none", t["powersgd_rank_within_tolerance"]
        lines += [
            f"Smallest PowerSGD rank within {pct} of none's perplexity: **{rank}** (ranks tried: {tried})."
            if rank is not None
            else f"No PowerSGD rank tried ({tried}) stayed within {pct} of none's perplexity after the same tokens.",
            "",
        ]
    return lines


def _auto_figure(v: dict[str, Any]) -> str:
    gpt = "final_ppl" in v
    value, base = (v["final_ppl"], v["none_final_ppl"]) if gpt else (v["final_acc"], v["none_final_acc"])
    if value is None:
        return "failed" if v["accuracy_error"] else "-"
    if gpt:
        return f"{value:.3f} ({value / base:.4f}x none's)" if base else f"{value:.3f}"
    return f"{100 * value:.1f} ({100 * (value - base):+.1f} points)" if base is not None else f"{100 * value:.1f}"


def auto_lines(data: dict[str, Any]) -> list[str]:
    """Part 1b's section; empty for results without the auto arm."""
    summary = data.get("auto")
    if not summary:
        return []
    gpt = data.get("model") == "gpt"
    config = next((c for c in data["compression_configs"] if c["name"] == AUTO), {})
    interval = config.get("auto_interval")
    what = "validation perplexity" if gpt else "validation accuracy"
    rows = [
        [
            LABELS.get(key, key),
            f"{fmt(v['step_ms'], '.0f')}{_failed(v, True)}",
            f"{v['best'] or '-'}: {fmt(v['best_step_ms'], '.0f')}",
            f"**{fmt(v['over_best'], '.3f')}**",
            f"{v['fastest'] or '-'}: {fmt(v['over_fastest'], '.3f')}",
            _auto_figure(v),
        ]
        for key, v in summary.items()
    ]
    head = ["link", "auto step (ms)", "best fixed: step (ms)", f"auto / best (target <= {CLUSTER_TARGET:.2f})"]
    head += ["fastest fixed: auto / it", f"auto's {what}{'' if gpt else ' (%)'} after {data['acc_steps']} steps"]
    lines = [
        f"**1b. gradient_compression='auto' on the same links** (`MirroredStrategy(gradient_compression='auto',"
        f" powersgd_rank={config.get('powersgd_rank')}, powersgd_start_iter={config.get('powersgd_start_iter')}"
        f"{'' if interval is None else f', auto_interval={interval}'})`; best fixed = the fastest setting within the"
        f" 5x verdict's bounds, none always counting; auto's {what} from one run on each shaped link).",
        "",
        *markdown_table(head, rows),
        "",
    ]
    for key, v in summary.items():
        long = v["long_run"]
        under = ", ".join(f"{n} {k}" for n, k in (long["timed_steps"] or {}).items())
        lines.append(
            f"- {LABELS.get(key, key)}: {choice_text(v['choices'])}."
            + (f" Long run: {under} steps, {long['step_ms']:.0f} ms/step." if under and long["step_ms"] else "")
        )
    return [*lines, ""]


def uneven_lines(data: dict[str, Any]) -> list[str]:
    """Parts 2 and 3's sections."""
    lines: list[str] = []
    hidden = "-".join(str(h) for h in data["ps_hidden"])
    ps, bal = data.get("ps"), data.get("balance")
    if ps is not None:
        head = ["configuration", "samples/s", "vs ds_mirrored", "final val acc (%)", "acc vs ds_mirrored (points)"]
        head += ["samples", "steps w0 / w1", "median step w0 / w1 (ms)"]
        rows = [
            [
                name + _failed(v),
                fmt(v["samples_per_s"], ".0f"),
                fmt(v.get("throughput_over_mirrored"), ".2f"),
                fmt(v["final_acc"], ".1f", 100),
                fmt(v.get("acc_points_vs_mirrored"), "+.1f"),
                fmt(v["samples"], ".0f"),
                f"{fmt(v['steps_w0'], '.0f')} / {fmt(v['steps_w1'], '.0f')}",
                f"{fmt(v['step_ms_w0'], '.0f')} / {fmt(v['step_ms_w1'], '.0f')}",
            ]
            for name, v in ps.items()
        ]
        lines += [
            f"**2. ds_parameter_server vs ds_mirrored, worker links {UNEVEN_MBIT[0]:.0f} and {UNEVEN_MBIT[1]:.0f}"
            f" Mbit/s** (MLP 64-{hidden}-10, {WORKERS * data['ps_steps'] * BATCH} samples in all).",
            "",
            *markdown_table(head, rows),
            "",
        ]
    if bal is not None:
        head = ["configuration", "epoch (s)", "median step, rank 0 (ms)", "compute/sample rank 0 / rank 1 (ms)"]
        head += ["final rank-0 share", "final sizes", "final val acc (%)"]
        rows = [
            [
                name + _failed(v),
                fmt(v["epoch_s"], ".2f"),
                fmt(v["step_ms"], ".0f"),
                f"{fmt(v['compute_ms_per_sample_r0'], '.3f')} / {fmt(v['compute_ms_per_sample_r1'], '.3f')}",
                fmt(v["final_share_rank0"], ".3f"),
                ", ".join(str(x) for x in v["final_sizes"]) or "-",
                fmt(v["final_acc"], ".1f", 100),
            ]
            for name, v in ((n, bal[n]) for n in (EQUAL, BALANCED) if n in bal)
        ]
        ratios = [
            ["epoch time", fmt(bal["ratio_epoch"], ".3f")],
            ["median step time, rank 0", fmt(bal["ratio_step"], ".3f")],
        ]
        lines += [
            f"**3. DynamicLoadBalancer vs the equal split on the same link** (ds_mirrored, MLP 64-{hidden}-10, global"
            f" batch {data['global_batch']}, balanced `interval={data['interval']}`; {data['balance_warmup_epochs']}"
            f" warm-up + {data['balance_epochs']} timed epochs).",
            "",
            *markdown_table(head, rows),
            "",
            *markdown_table(["balanced / equal, per repeat", "median [min - max]"], ratios),
            "",
        ]
    return lines


def markdown(data: dict[str, Any]) -> list[str]:
    """Parts 1-3's page."""
    lines = [title(data), "", setup_line(data), ""]
    if data.get("compression") is not None:
        lines += part1_lines(data)
    return [*lines, *auto_lines(data), *uneven_lines(data)]


def plot(data: dict[str, Any], path: Path) -> None:
    """One bar chart per measured link of part 1 (labels: speed-up over none), then parts 2 and 3's."""
    comp, links = data.get("compression") or {}, measured_links(data)
    arms: dict[str, dict[str, Any]] = {}
    for link in links:
        for name, v in comp[link["key"]].items():
            arms.setdefault(name, {})[link["key"]] = v["step_ms"]
            arms[name][f"{link['key']}_speedup"] = v["speedup_over_none"]
    panels = [Panel(k["key"], f"1. {k['label']}: step, rank 0 (ms, log)", f"{k['key']}_speedup", True) for k in links]
    if data.get("ps"):
        arms |= data["ps"]
        panels.append(Panel("samples_per_s", "2. samples/s, both workers", "throughput_over_mirrored"))
    if data.get("balance"):
        arms |= {n: data["balance"][n] for n in (EQUAL, BALANCED) if n in data["balance"]}
        panels.append(Panel("epoch_s", "3. epoch time, rank 0 (s)"))
    bar_panels(path, arms, panels, title(data).removeprefix("# "))
