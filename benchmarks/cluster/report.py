"""The cluster benchmark's constants and its report: the markdown tables, the notes and the chart, all computed from
the flat view of a finished run (``Cluster.view`` in ``driver.py``), so ``--render`` needs no cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.cluster.launch import WORKERS
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.figures import save_figure

BATCH = 32
LR = 0.05
TARGET_SPEEDUP = 5.0  # best compression vs none at 100 Mbit/s
ACC_TOLERANCE_POINTS = 1.0  # "equal accuracy": validation accuracy after the long run, in points
NO_NETEM = "not measured: this kernel has no netem"
# Part 1's links: both workers' links shaped alike.
LINKS: list[dict[str, Any]] = [
    {"key": "1gbit", "label": "1 Gbit/s", "rate_mbit": 1000.0, "delay_ms": None},
    {"key": "100mbit", "label": "100 Mbit/s", "rate_mbit": 100.0, "delay_ms": None},
    {"key": "1gbit_1ms", "label": "1 Gbit/s + 1 ms delay", "rate_mbit": 1000.0, "delay_ms": 1.0},
    {"key": "100mbit_1ms", "label": "100 Mbit/s + 1 ms delay", "rate_mbit": 100.0, "delay_ms": 1.0},
]
TARGET_LINK = "100mbit"
GPT_LINKS = ("1gbit", "100mbit")  # the GPT's part 1: the two rates, no delay
GPT_LR = 1e-3  # AdamW, betas (0.9, 0.95), weight decay 0.1: learns the bytes within a few hundred steps
PPL_TOLERANCE = 0.02  # "equal perplexity": within 2% of none's (relative), after the same tokens
# Parts 2 and 3: worker 0's link 10x faster than worker 1's; the server's link unshaped.
UNEVEN_MBIT = (1000.0, 100.0)
MIRRORED = "ds_mirrored"
EQUAL = "equal"
BALANCED = "balanced"


def links_of(model: str | None) -> list[dict[str, Any]]:
    """Part 1's links for a workload: all four for the digits, the two rates for the GPT."""
    return [link for link in LINKS if model != "gpt" or link["key"] in GPT_LINKS]


def title(data: dict[str, Any]) -> str:
    """The page's first line: the workload it measured (parts 2 and 3 always train the digits)."""
    parts = data.get("parts") or ["compression", "ps", "balance"]
    small = f"64-{'-'.join(str(h) for h in data['ps_hidden'])}-10"
    if data.get("model") == "gpt":
        label = data.get("workload_label") or _workloads.label(data.get("workload") or {"model": "gpt"})
        rest = f" (parts 2 and 3: digits MLP {small})" if {"ps", "balance"} & set(parts) else ""
        return f"# Network-namespace cluster on the {label}{rest}"
    big = _workloads.label({"model": "digits"}, data["hidden"])
    return f"# Network-namespace cluster on the {big} (parts 2 and 3: {small})"


def _fmt(v: dict[str, Any] | None, f: str = ".0f", scale: float = 1.0) -> str:
    return harness.fmt(v, f, scale)


def _params(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.2f}M"


def markdown(data: dict[str, Any], part1: list[str] | None = None, auto: list[str] | None = None) -> list[str]:
    """The tables and notes, from the flat view of :meth:`Cluster.view`; ``part1``, if given, replaces part 1's
    section (the GPT's, from ``compression.gpt_markdown``); ``auto`` follows part 1 (the auto arm's)."""
    setup = data["setup"]
    hidden = "-".join(str(h) for h in data["hidden"])
    ps_hidden = "-".join(str(h) for h in data["ps_hidden"])
    probes = setup.get("probes", {})
    probe_text = ", ".join(f"{k}: {v:.0f} Mbit/s" if v else f"{k}: failed" for k, v in probes.items())
    lines = [
        title(data),
        "",
        f"**Setup.** A network-namespace cluster of 3 hosts on one bridge (host 0 and host 1: the workers; host 2: the"
        f" parameter server), built by `ds_lightning.testing.netns.Cluster`; one process per TF_CONFIG task, 1 thread"
        f" each, gloo, `Trainer(devices=1)`, no MASTER_ADDR/MASTER_PORT/GLOO_SOCKET_IFNAME in the environment (the pack"
        f" picks each task's interface). Links shaped on both directions of a host's veth by `Cluster.shape`"
        f" (qdisc: {setup.get('qdisc_kind', '?')}). Measured TCP throughput host 1 -> host 0 (one stream, Python"
        f" sockets): {probe_text or 'not probed'}. {data['repeats']} interleaved repeat(s); median [min - max] over"
        f" repeats, ratios taken per repeat. Total time {data['seconds'] / 60:.1f} min on a shared 2-core machine.",
        "",
    ]
    comp = data.get("compression")
    if comp is not None and part1 is not None:
        lines += part1
    elif comp is not None:
        acc = data.get("accuracy", {})
        names = [c["name"] for c in data["compression_configs"] if c["compression"] != "auto"]  # auto: its own table
        params = data.get("params")
        lines += [
            f"**1. ds_mirrored gradient_compression on shaped links** (2 worker hosts, both links shaped alike;"
            f" MLP 64-{hidden}-10 = {_params(params)} parameters, DigitsClassifier, SGD lr {LR} momentum 0.9, batch"
            f" {BATCH} per worker; {data['warmup']} warm-up + {data['steps']} timed steps per run; step time = rank 0's"
            " median over the timed steps, batch start to batch end;"
            f" powersgd_start_iter={data['powersgd_start_iter']}: only the first warm-up step is a plain all-reduce,"
            " every timed step is compressed). Speedup ="
            f" none's step time / the setting's, per repeat. Accuracy: validation accuracy of rank 0's final"
            f" parameters (360 held-out digits), after the {data['warmup'] + data['steps']} steps of the shaped runs"
            f" (median over all their runs), and after {data['acc_steps']} steps in one extra run per setting on the"
            " unshaped cluster link (same seed and data order; the link changes a step's duration, not its result).",
            "",
        ]
        steps_short = data["warmup"] + data["steps"]
        head = "| gradient_compression | MB/step (timed) |"
        sep = "|---|---|"
        for link in LINKS:
            head += f" {link['label']}: step (ms); speedup |"
            sep += "---|"
        head += f" unshaped step (ms), 1 run | val acc after {steps_short} steps (%)"
        head += f" | val acc after {data['acc_steps']} steps (%) |"
        sep += "---|---|---|"
        lines += [head, sep]
        for name in names:
            mb = next(
                (comp[k][name]["bytes_per_step"] for k in comp if comp[k].get(name, {}).get("bytes_per_step")), None
            )
            row = f"| {name} | {'-' if mb is None else format(mb['median'] / 1e6, '.3f')} |"
            accs: list[float] = []
            for link in LINKS:
                if link["key"] in setup["unsupported"]:
                    row += f" {NO_NETEM} |"
                    continue
                v = comp.get(link["key"], {}).get(name)
                if v is None or v["step_ms"] is None:
                    row += f" failed ({v['failed_runs']} of {v['runs']}) |" if v else " - |"
                    continue
                failed = f" ({v['failed_runs']} of {v['runs']} failed)" if v["failed_runs"] else ""
                speed = "" if name == "none" else f"; **{_fmt(v['speedup_over_none'], '.2f')}x**"
                row += f" {_fmt(v['step_ms'], '.0f')}{failed}{speed} |"
                accs += [r["final_acc"] for r in data["raw"]["compression"][link["key"]][name] if "error" not in r]
            a = acc.get(name, {})
            unshaped = f"{a['median_step_ms']:.0f}" if "median_step_ms" in a else "failed"
            long = f"{100 * a['final_acc']:.1f}" if "final_acc" in a else "failed"
            lines.append(row + f" {unshaped} | {_fmt(harness.spread(accs), '.1f', 100)} | {long} |")
        t = data["targets"][0]
        result = t.get("verdict") or harness.verdict(t["value"], at_least=TARGET_SPEEDUP)
        lines += [
            "",
            "| target | goal | measured | result |",
            "|---|---|---|---|",
            f"| {t['target']} | {t['goal']} | {t['best'] or '-'}: {_fmt(t['value'], '.2f')}x | {result} |",
            "",
        ]
        for name, points in t.get("excluded_for_accuracy_points", {}).items():
            why = "its accuracy run failed" if points is None else f"{points:+.1f} points vs none after the same steps"
            lines += [f"{name} is left out of the verdict: {why}.", ""]
        if setup["unsupported"]:
            lines += [
                f"The 1 ms delay cells: `Cluster.shape(host, rate_mbit=..., delay_ms=1)` raised"
                f" `ShapingUnsupportedError` ({NO_NETEM}; tbf can limit the rate but not add delay), so they hold no"
                " numbers.",
                "",
            ]
    lines += auto or []
    ps = data.get("ps")
    if ps is not None:
        lines += [
            f"**2. ds_parameter_server vs ds_mirrored, worker links 10x apart** (worker 0 at"
            f" {UNEVEN_MBIT[0]:.0f} Mbit/s, worker 1 at {UNEVEN_MBIT[1]:.0f} Mbit/s, the server's link unshaped; MLP"
            f" 64-{ps_hidden}-10, batch {BATCH} per worker, equal samples: ds_mirrored {data['ps_steps']} steps per"
            f" worker = {WORKERS * data['ps_steps'] * BATCH} samples, ds_parameter_server an update budget of the same"
            " samples, fast workers doing more of them). Samples/s: samples of both workers / (last step end - first"
            " step start). Accuracy: rank 0's parameters after fit (under ds_parameter_server the servers' last ones).",
            "",
            "| configuration | samples/s | vs ds_mirrored | final val acc (%) | acc vs ds_mirrored (points) | samples"
            " | steps w0 / w1 | median step w0 / w1 (ms) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, v in ps.items():
            failed = f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""
            lines.append(
                f"| {name}{failed} | {_fmt(v['samples_per_s'])} | {_fmt(v.get('throughput_over_mirrored'), '.2f')}"
                f" | {_fmt(v['final_acc'], '.1f', 100)} | {_fmt(v.get('acc_points_vs_mirrored'), '+.1f')}"
                f" | {_fmt(v['samples'])} | {_fmt(v['steps_w0'])} / {_fmt(v['steps_w1'])}"
                f" | {_fmt(v['step_ms_w0'])} / {_fmt(v['step_ms_w1'])} |"
            )
        lines.append("")
    bal = data.get("balance")
    if bal is not None:
        lines += [
            "**3. DynamicLoadBalancer vs the equal split on the same uneven link**"
            f" (ds_mirrored, MLP 64-{ps_hidden}-10, global batch {data['global_batch']}; equal split ="
            " `DynamicLoadBalancer(interval=0,"
            f" initial_shares=[1, 1])`, balanced = `interval={data['interval']}`; {data['balance_warmup_epochs']}"
            f" warm-up + {data['balance_epochs']} timed epochs; epoch time = rank 0's, median over the timed epochs."
            " Compute per sample = batch start to the launch of the last gradient bucket (what the balancer"
            " measures) / local batch).",
            "",
            "| configuration | epoch (s) | median step, rank 0 (ms) | compute/sample rank 0 / rank 1 (ms)"
            " | final rank-0 share | final sizes | final val acc (%) |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in (EQUAL, BALANCED):
            v = bal.get(name)
            if v is None:
                continue
            failed = f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""
            sizes = ", ".join(str(x) for x in v["final_sizes"]) or "-"
            lines.append(
                f"| {name}{failed} | {_fmt(v['epoch_s'], '.2f')} | {_fmt(v['step_ms'])}"
                f" | {_fmt(v['compute_ms_per_sample_r0'], '.3f')} / {_fmt(v['compute_ms_per_sample_r1'], '.3f')}"
                f" | {_fmt(v['final_share_rank0'], '.3f')} | {sizes} | {_fmt(v['final_acc'], '.1f', 100)} |"
            )
        lines += [
            "",
            "| balanced / equal, per repeat | median [min - max] |",
            "|---|---|",
            f"| epoch time | {_fmt(bal['ratio_epoch'], '.3f')} |",
            f"| median step time, rank 0 | {_fmt(bal['ratio_step'], '.3f')} |",
            "",
        ]
    return [*lines, *data.get("notes", [])]


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib  # here: running the benchmark needs no matplotlib until it writes

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpt = data.get("model") == "gpt"
    lower = not gpt or bool(data.get("ps") or data.get("balance"))  # the GPT's default run has part 1 only
    fig, axes = plt.subplots(2 if lower else 1, 2, figsize=(14, 9 if lower else 5), squeeze=False)
    comp = data.get("compression") or {}
    names = [c["name"] for c in data.get("compression_configs", [])]
    measured = [link for link in LINKS if link["key"] in comp and link["key"] not in data["setup"]["unsupported"]]
    ax = axes[0][0]
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        xs, med, lo, hi = [], [], [], []
        for i, link in enumerate(measured):
            v = comp[link["key"]].get(name, {}).get("step_ms")
            if v:
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                med.append(v["median"])
                lo.append(v["median"] - v["min"])
                hi.append(v["max"] - v["median"])
        ax.bar(xs, med, width=width, yerr=[lo, hi], capsize=3, label=name)
        for x, link in zip(xs, measured, strict=False):
            s = comp[link["key"]][name]["speedup_over_none"]
            if s and name != "none":
                top = comp[link["key"]][name]["step_ms"]["max"]
                ax.annotate(f"{s['median']:.1f}x", (x, top), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(measured)), [link["label"] for link in measured])
    ax.set_yscale("log")
    ax.set_ylabel("median step time, rank 0 (ms, log)")
    missing = [link["label"] for link in LINKS if link["key"] in data["setup"]["unsupported"]]
    heading = f"1. ds_mirrored, {_params(data.get('params'))} params, 2 hosts (label: speedup over none)"
    if missing:
        heading += f"\nnot measured (no netem): {', '.join(missing)}"
    ax.set_title(heading, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")

    if gpt:
        _perplexity_panel(axes[0][1], data, names)
        fig.suptitle(title(data).removeprefix("# "), fontsize=9)
    else:
        _accuracy_panel(axes[0][1], data, names)
    if lower:
        _lower_panels(axes, data)
    fig.tight_layout()
    save_figure(fig, path)


def _perplexity_panel(ax: Any, data: dict[str, Any], names: list[str]) -> None:
    """Each setting's perplexity relative to none's (in %, what the 2% rule reads), its value as the label."""
    ppl = data.get("accuracy") or {}
    base = ppl.get("none", {}).get("final_ppl")
    shown = [n for n in names if "final_ppl" in ppl.get(n, {})] if base else []
    excess = [100 * (ppl[n]["final_ppl"] / base - 1) for n in shown]
    ax.bar(range(len(shown)), excess, color=["tab:green" if e <= 100 * PPL_TOLERANCE else "tab:red" for e in excess])
    for i, (n, e) in enumerate(zip(shown, excess, strict=True)):
        ax.annotate(f"{ppl[n]['final_ppl']:.2f}", (i, e), ha="center", va="bottom" if e >= 0 else "top", fontsize=8)
    ax.axhline(100 * PPL_TOLERANCE, color="k", ls="--", lw=1, label=f"limit: none + {100 * PPL_TOLERANCE:g}%")
    ax.axhline(0, color="k", lw=0.8)
    ax.legend(fontsize=8)
    ax.set_xticks(range(len(shown)), shown, rotation=20)
    ax.set_ylabel("validation perplexity vs none's (%)")
    tokens = WORKERS * data.get("batch_size", 0) * data.get("gpt_block", 0) * (data.get("acc_steps") or 0)
    ax.set_title(
        f"1. after {data.get('acc_steps')} steps = {tokens:,} tokens, one run per setting, unshaped link"
        " (label: perplexity)",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="y")


def _accuracy_panel(ax: Any, data: dict[str, Any], names: list[str]) -> None:
    acc = data.get("accuracy") or {}
    shown = [n for n in names if "final_acc" in acc.get(n, {})]
    ax.bar(range(len(shown)), [100 * acc[n]["final_acc"] for n in shown], color="tab:green")
    for i, n in enumerate(shown):
        ax.annotate(f"{100 * acc[n]['final_acc']:.1f}", (i, 100 * acc[n]["final_acc"]), ha="center", va="bottom")
    ax.set_xticks(range(len(shown)), shown)
    ax.set_ylim(0, 105)
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(f"1. accuracy after {data.get('acc_steps')} steps (one run per setting, unshaped link)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def _lower_panels(axes: Any, data: dict[str, Any]) -> None:
    ax = axes[1][0]
    ps = data.get("ps") or {}
    shown = [n for n in ps if ps[n]["samples_per_s"]]
    med = [ps[n]["samples_per_s"]["median"] for n in shown]
    err = [
        [m - ps[n]["samples_per_s"]["min"] for n, m in zip(shown, med, strict=True)],
        [ps[n]["samples_per_s"]["max"] - m for n, m in zip(shown, med, strict=True)],
    ]
    ax.bar(range(len(shown)), med, yerr=err, capsize=4, color=["tab:gray", "tab:blue", "tab:orange"][: len(shown)])
    for i, n in enumerate(shown):
        a = ps[n]["final_acc"]
        label = f"acc {100 * a['median']:.1f}%" if a else ""
        ratio = ps[n].get("throughput_over_mirrored")
        if ratio:
            label = f"{ratio['median']:.2f}x, {label}"
        ax.annotate(label, (i, ps[n]["samples_per_s"]["max"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shown)), shown)
    ax.set_ylabel("samples/s, both workers (median, min-max)")
    ax.set_title(
        f"2. worker links {UNEVEN_MBIT[0]:.0f} / {UNEVEN_MBIT[1]:.0f} Mbit/s, equal samples (label: vs ds_mirrored)",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="y")

    ax = axes[1][1]
    raw = (data.get("raw") or {}).get("balance") or {}
    colors = {EQUAL: "tab:gray", BALANCED: "tab:blue"}
    for name in (EQUAL, BALANCED):
        for i, run in enumerate(r for r in raw.get(name, []) if "error" not in r):
            label = f"{name}: step time" if i == 0 else None
            ax.plot(range(len(run["step_ms"])), run["step_ms"], color=colors[name], alpha=0.6, lw=1, label=label)
    twin = ax.twinx()
    for name in (EQUAL, BALANCED):
        for i, run in enumerate(r for r in raw.get(name, []) if "error" not in r):
            shares = [s[0] / sum(s) for s in run["sizes"]]
            label = f"{name}: rank-0 share" if i == 0 else None
            twin.plot(range(len(shares)), shares, "--", color=colors[name], alpha=0.8, lw=1, label=label)
    twin.set_ylim(0, 1)
    twin.set_ylabel("rank 0's share of the global batch (dashed)")
    ax.set_xlabel("step")
    ax.set_ylabel("step time, rank 0 (ms)")
    ratio = (data.get("balance") or {}).get("ratio_epoch")
    title = "3. DynamicLoadBalancer vs equal split, same uneven link"
    if ratio:
        title += f"; epoch time balanced / equal {ratio['median']:.3f}"
    ax.set_title(title, fontsize=9)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)


def notes(data: dict[str, Any]) -> list[str]:
    """Observations computed from the figures, so they always describe the numbers above them."""
    out = []
    comp = data.get("compression") or {}
    for link in LINKS:
        v = comp.get(link["key"], {}).get("none") or {}
        if v.get("step_ms") and v.get("bytes_per_step"):
            payload = v["bytes_per_step"]["median"]
            wire_ms = payload * 8 / (link["rate_mbit"] * 1e6) * 1e3
            out.append(
                f"- {link['label']}: none takes {v['step_ms']['median']:.0f} ms per step; its {payload / 1e6:.1f} MB"
                f" of gradients alone need {wire_ms:.0f} ms at the link rate (a 2-rank ring all-reduce sends about the"
                " payload once each way)."
            )
    acc = data.get("accuracy") or {}
    base = acc.get("none", {})
    if "final_acc" in base:
        same = [
            n
            for n, a in acc.items()
            if n != "none" and a.get("final_acc") == base["final_acc"] and a.get("param_checksum") is not None
        ]
        moved = [n for n in same if acc[n]["param_checksum"] != base.get("param_checksum")]
        if moved:
            out.append(
                f"- {', '.join(moved)} {'ends' if len(moved) == 1 else 'end'} with the same accuracy as none after"
                f" {data['acc_steps']} steps, but not the"
                " same parameters (sum of |parameters|: "
                + ", ".join(f"{n} {acc[n]['param_checksum']:.4f}" for n in ["none", *moved])
                + "): the narrower all-reduce rounds the gradients, too little to change a prediction here."
            )
        for n, a in acc.items():
            if n != "none" and "final_acc" in a and a["final_acc"] < base["final_acc"] - 0.02:
                out.append(
                    f"- {n} is {100 * (base['final_acc'] - a['final_acc']):.1f} points below none after"
                    f" {data['acc_steps']} steps (powersgd_start_iter={data['powersgd_start_iter']}: compressed from"
                    f" step {data['powersgd_start_iter'] + 1} on; starting PowerSGD later, as its authors recommend,"
                    " keeps more accuracy at the price of uncompressed early steps)."
                )
    ps = data.get("ps") or {}
    for name, v in ps.items():
        if name != MIRRORED and v.get("steps_w0") and v.get("throughput_over_mirrored"):
            out.append(
                f"- {name}: worker 0 (fast link) ran {v['steps_w0']['median']:.0f} steps of"
                f" {v['step_ms_w0']['median']:.0f} ms, worker 1 (slow link) {v['steps_w1']['median']:.0f} of"
                f" {v['step_ms_w1']['median']:.0f} ms (a pull and a push of the whole model per step); under"
                f" ds_mirrored both wait for the slow link every step ({ps[MIRRORED]['step_ms_w0']['median']:.0f} ms)."
                f" Throughput {v['throughput_over_mirrored']['median']:.2f}x ds_mirrored's."
                if ps.get(MIRRORED, {}).get("step_ms_w0")
                else f"- {name}: throughput {v['throughput_over_mirrored']['median']:.2f}x ds_mirrored's."
            )
    bal = data.get("balance") or {}
    v, e = bal.get(BALANCED) or {}, bal.get(EQUAL) or {}
    if v.get("final_share_rank0") and e.get("compute_ms_per_sample_r0") and e.get("step_ms"):
        share, ratio = v["final_share_rank0"], bal.get("ratio_epoch")
        out.append(
            "- DynamicLoadBalancer divides the batch by compute throughput, timed up to the launch of the last gradient"
            " bucket, which leaves the all-reduce out. Under the equal split that compute was"
            f" {e['compute_ms_per_sample_r0']['median']:.3f} / {e['compute_ms_per_sample_r1']['median']:.3f} ms per"
            f" sample on rank 0 / rank 1 (median), about"
            f" {e['compute_ms_per_sample_r0']['median'] * data['global_batch'] / WORKERS:.0f} ms per rank per step"
            f" out of a {e['step_ms']['median']:.0f} ms step: the"
            " all-reduce over the slow link dominates and waits for it whatever the split. So the balancer has no"
            " real imbalance to correct; its final rank-0 share was"
            f" {share['median']:.3f} [{share['min']:.3f} - {share['max']:.3f}] (following noise in the compute"
            f" measurement on this shared machine) and the epoch time balanced / equal {_fmt(ratio, '.3f')}."
        )
    return ["**Notes**", "", *out] if out else []
