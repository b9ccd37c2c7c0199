"""The cluster benchmark's constants and its page: tables, notes and chart, all from the flat view of a finished run
(``Cluster.view``), so ``--render`` needs no cluster. The method is in README.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness import Panel, bar_panels, fmt, markdown_table, spread, verdict
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


def links_of(model: str | None) -> list[dict[str, Any]]:
    return [link for link in LINKS if model != "gpt" or link["key"] in GPT_LINKS]


def title(data: dict[str, Any]) -> str:
    """The page's first line: the workload it measured (parts 2 and 3 always train the digits)."""
    small = f"64-{'-'.join(str(h) for h in data['ps_hidden'])}-10"
    if data.get("model") == "gpt":
        label = data.get("workload_label") or _workloads.label(data.get("workload") or {"model": "gpt"})
        rest = f" (parts 2 and 3: digits MLP {small})" if {"ps", "balance"} & set(data["parts"]) else ""
        return f"# Network-namespace cluster on the {label}{rest}"
    big = _workloads.label({"model": "digits"}, data["hidden"])
    return f"# Network-namespace cluster on the {big} (parts 2 and 3: {small})"


def _params(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.2f}M"


def _part1_intro(data: dict[str, Any], gpt: bool) -> str:
    head = "**1. ds_mirrored gradient_compression on shaped links** (2 worker hosts, both links shaped alike;"
    if gpt:
        tokens = WORKERS * data["batch_size"] * data["gpt_block"]
        return (
            f"{head} {data.get('workload_label', 'GPT')}, {_params(data.get('params'))} parameters, AdamW lr"
            f" {GPT_LR:g} betas (0.9, 0.95) weight decay 0.1; batch {data['batch_size']} windows of {data['gpt_block']}"
            f" tokens per worker = {tokens} tokens per step; {data['warmup']} warm-up + {data['steps']} timed steps per"
            " run; step time = rank 0's median over the timed steps, batch start to batch end; tokens/s = tokens per"
            f" step / step time; powersgd_start_iter={data['powersgd_start_iter']}). Speedup = none's step time / the"
            " setting's, per repeat. Perplexity: exp of the mean token cross-entropy of rank 0's final parameters on"
            f" the first {data['val_windows']} windows ({data['val_windows'] * data['gpt_block']} tokens) of"
            f" TextDataModule's validation split, after {data['acc_steps']} steps = {tokens * data['acc_steps']:,}"
            " tokens in one extra run per setting on the unshaped cluster link (same seed, initial parameters and data"
            " order; the link changes a step's duration, not its result)."
        )
    return (
        f"{head} MLP 64-{'-'.join(str(h) for h in data['hidden'])}-10 = {_params(data.get('params'))} parameters,"
        f" DigitsClassifier, SGD lr {LR} momentum 0.9, batch {BATCH} per worker; {data['warmup']} warm-up +"
        f" {data['steps']} timed steps per run; step time = rank 0's median over the timed steps, batch start to batch"
        f" end; powersgd_start_iter={data['powersgd_start_iter']}: only the first warm-up step is a plain all-reduce,"
        " every timed step is compressed). Speedup = none's step time / the setting's, per repeat. Accuracy:"
        " validation accuracy of rank 0's final parameters (360 held-out digits), after the"
        f" {data['warmup'] + data['steps']} steps of the shaped runs (median over all their runs), and after"
        f" {data['acc_steps']} steps in one extra run per setting on the unshaped cluster link (same seed and data"
        " order; the link changes a step's duration, not its result)."
    )


def part1_lines(data: dict[str, Any]) -> list[str]:
    """Part 1's section: per setting and link the step time and speed-up (the GPT's tokens/s too), the accuracy or
    perplexity of the long run, and the verdict counting only settings within its bounds."""
    gpt = data.get("model") == "gpt"
    comp, acc, setup, t = data["compression"], data.get("accuracy") or {}, data["setup"], data["targets"][0]
    links = [link for link in links_of("gpt") if link["key"] in comp] if gpt else LINKS
    tokens = WORKERS * data["batch_size"] * data["gpt_block"] if gpt else 0
    head = ["gradient_compression", "MB/step (timed)"]
    for link in links:
        label = link["label"]
        head += (
            [f"{label}: step (ms)", f"{label}: tokens/s", f"{label}: speedup"]
            if gpt
            else [f"{label}: step (ms); speedup"]
        )
    if gpt:
        head += ["unshaped step (ms), 1 run", f"val perplexity after {tokens * data['acc_steps']:,} tokens", "vs none"]
    else:
        short = data["warmup"] + data["steps"]
        head += [
            "unshaped step (ms), 1 run",
            f"val acc after {short} steps (%)",
            f"val acc after {data['acc_steps']} steps (%)",
        ]
    rows = []
    for name in [c["name"] for c in data["compression_configs"] if c["compression"] != AUTO]:
        mb = next((comp[k][name]["bytes_per_step"] for k in comp if comp[k].get(name, {}).get("bytes_per_step")), None)
        row = [name, "-" if mb is None else f"{mb['median'] / 1e6:.3f}"]
        accs: list[float] = []
        for link in links:
            if link["key"] in setup["unsupported"]:
                row.append(NO_NETEM)
                continue
            v = comp.get(link["key"], {}).get(name)
            if v is None or v["step_ms"] is None:
                row += [f"failed ({v['failed_runs']} of {v['runs']})" if v else "-"] + ["-", "-"] * gpt
                continue
            failed = f" ({v['failed_runs']} of {v['runs']} failed)" if v["failed_runs"] else ""
            speed = f"**{fmt(v['speedup_over_none'], '.2f')}x**"
            if gpt:
                row += [f"{fmt(v['step_ms'], '.0f')}{failed}", fmt(v.get("tokens_per_s"), ".0f")]
                row.append("1" if name == "none" else speed)
            else:
                row.append(f"{fmt(v['step_ms'], '.0f')}{failed}" + ("" if name == "none" else f"; {speed}"))
                accs += [r["final_acc"] for r in data["raw"]["compression"][link["key"]][name] if "error" not in r]
        a = acc.get(name, {})
        row.append(f"{a['median_step_ms']:.0f}" if "median_step_ms" in a else "failed")
        if gpt:
            ratio = t.get("ppl_ratio", {}).get(name)
            row += [
                f"{a['final_ppl']:.3f}" if "final_ppl" in a else "failed",
                "-" if ratio is None else f"{ratio:.4f}x",
            ]
        else:
            long = f"{100 * a['final_acc']:.1f}" if "final_acc" in a else "failed"
            row += [fmt(spread(accs), ".1f", 100), long]
        rows.append(row)
    measured = f"{t['best'] or '-'}: {fmt(t['value'], '.2f')}x"
    lines = [_part1_intro(data, gpt), "", *markdown_table(head, rows), ""]
    lines += [
        *markdown_table(["target", "goal", "measured", "result"], [[t["target"], t["goal"], measured, t["verdict"]]])
    ]
    lines.append("")
    limit = f" (limit {1 + PPL_TOLERANCE:g}x)" if gpt else ""
    for name, x in t.get("excluded_for_ppl_ratio" if gpt else "excluded_for_accuracy_points", {}).items():
        what = "perplexity" if gpt else "accuracy"
        why = (
            f"its {what} run failed"
            if x is None
            else (f"its perplexity is {x:.4f}x none's" if gpt else f"{x:+.1f} points vs none after the same steps")
        )
        lines += [f"{name} is left out of the verdict: {why}{limit}.", ""]
    pct = f"{100 * PPL_TOLERANCE:g}%"
    if gpt:
        tried, rank = ", ".join(str(r) for r in t["powersgd_ranks"]) or "none", t["powersgd_rank_within_tolerance"]
        lines.append(
            f"Smallest PowerSGD rank within {pct} of none's perplexity: **{rank}** (ranks tried: {tried})."
            if rank is not None
            else f"No PowerSGD rank tried ({tried}) stayed within {pct} of none's perplexity after the same tokens."
        )
        lines.append("")
    elif setup["unsupported"]:
        lines += [
            "The 1 ms delay cells: `Cluster.shape(host, rate_mbit=..., delay_ms=1)` raised `ShapingUnsupportedError`"
            f" ({NO_NETEM}; tbf can limit the rate but not add delay), so they hold no numbers.",
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


def _auto_result(v: dict[str, Any]) -> str:
    """The step-time verdict and, when it is met, whether the accuracy or perplexity held."""
    speed = verdict(v["over_best"], at_most=CLUSTER_TARGET)
    figure = "perplexity" if "final_ppl" in v else "accuracy"
    if speed != "met":
        return f"{speed} (step time)" if speed in ("within noise", "missed") else speed
    return {True: "met", False: f"missed ({figure})", None: f"no {figure}"}[v["accuracy_met"]]


def auto_lines(data: dict[str, Any]) -> list[str]:
    """Part 1b's section; empty for results without the auto arm."""
    summary = data.get("auto")
    if not summary:
        return []
    gpt = data.get("model") == "gpt"
    config = next((c for c in data["compression_configs"] if c["name"] == AUTO), {})
    interval = config.get("auto_interval")
    what = "validation perplexity" if gpt else "validation accuracy"
    bound = (
        f"perplexity <= {1 + PPL_TOLERANCE:g}x none's"
        if gpt
        else f"accuracy >= none's - {ACC_TOLERANCE_POINTS:g} point"
    )
    rows = [
        [
            LABELS.get(key, key),
            f"{fmt(v['step_ms'], '.0f')}"
            + (f" ({v['failed_runs']} of {v['runs']} failed)" if v["failed_runs"] else ""),
            f"{v['best'] or '-'}: {fmt(v['best_step_ms'], '.0f')}",
            f"**{fmt(v['over_best'], '.3f')}**",
            f"{v['fastest'] or '-'}: {fmt(v['over_fastest'], '.3f')}",
            _auto_figure(v),
            _auto_result(v),
        ]
        for key, v in summary.items()
    ]
    head = ["link", "auto step (ms)", "best fixed: step (ms)", f"auto / best (target <= {CLUSTER_TARGET:.2f})"]
    head += [
        "fastest fixed: auto / it",
        f"auto's {what}{'' if gpt else ' (%)'} after {data['acc_steps']} steps",
        "result",
    ]
    lines = [
        f"**1b. gradient_compression='auto' on the same links** (`MirroredStrategy(gradient_compression='auto',"
        f" powersgd_rank={config.get('powersgd_rank')}, powersgd_start_iter={config.get('powersgd_start_iter')}"
        f"{'' if interval is None else f', auto_interval={interval}'})`: PowerSGD, when chosen, at the smallest rank"
        " the verdict admitted when the fixed settings were measured; auto's runs interleaved with the fixed settings'"
        " above, same steps). Best fixed = the fastest setting at that link among those within the verdict's bounds"
        f" ({bound} after the same steps; none always counts); auto / best and auto / the fastest of all, per"
        f" repeat. Target: auto / best <= {CLUSTER_TARGET:.2f} with auto's {what} within the same bounds. Auto's"
        f" {what}: one extra run of {data['acc_steps']} steps on each shaped link (what auto"
        " computes depends on the link it measures), against none's after the same steps (unshaped run above).",
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
        lines += [
            f"**2. ds_parameter_server vs ds_mirrored, worker links 10x apart** (worker 0 at"
            f" {UNEVEN_MBIT[0]:.0f} Mbit/s, worker 1 at {UNEVEN_MBIT[1]:.0f} Mbit/s, the server's link unshaped; MLP"
            f" 64-{hidden}-10, batch {BATCH} per worker, equal samples: ds_mirrored {data['ps_steps']} steps per"
            f" worker = {WORKERS * data['ps_steps'] * BATCH} samples, ds_parameter_server an update budget of the same"
            " samples, fast workers doing more of them). Samples/s: samples of both workers / (last step end - first"
            " step start). Accuracy: rank 0's parameters after fit (under ds_parameter_server the servers' last ones).",
            "",
        ]
        head = ["configuration", "samples/s", "vs ds_mirrored", "final val acc (%)", "acc vs ds_mirrored (points)"]
        rows = [
            [
                name + (f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""),
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
        lines += [*markdown_table([*head, "samples", "steps w0 / w1", "median step w0 / w1 (ms)"], rows), ""]
    if bal is not None:
        lines += [
            "**3. DynamicLoadBalancer vs the equal split on the same uneven link**"
            f" (ds_mirrored, MLP 64-{hidden}-10, global batch {data['global_batch']}; equal split ="
            " `DynamicLoadBalancer(interval=0,"
            f" initial_shares=[1, 1])`, balanced = `interval={data['interval']}`; {data['balance_warmup_epochs']}"
            f" warm-up + {data['balance_epochs']} timed epochs; epoch time = rank 0's, median over the timed epochs."
            " Compute per sample = batch start to the launch of the last gradient bucket (what the balancer"
            " measures) / local batch).",
            "",
        ]
        rows = [
            [
                name + (f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""),
                fmt(v["epoch_s"], ".2f"),
                fmt(v["step_ms"], ".0f"),
                f"{fmt(v['compute_ms_per_sample_r0'], '.3f')} / {fmt(v['compute_ms_per_sample_r1'], '.3f')}",
                fmt(v["final_share_rank0"], ".3f"),
                ", ".join(str(x) for x in v["final_sizes"]) or "-",
                fmt(v["final_acc"], ".1f", 100),
            ]
            for name, v in ((n, bal[n]) for n in (EQUAL, BALANCED) if n in bal)
        ]
        head = ["configuration", "epoch (s)", "median step, rank 0 (ms)", "compute/sample rank 0 / rank 1 (ms)"]
        lines += [*markdown_table([*head, "final rank-0 share", "final sizes", "final val acc (%)"], rows), ""]
        ratios = [
            ["epoch time", fmt(bal["ratio_epoch"], ".3f")],
            ["median step time, rank 0", fmt(bal["ratio_step"], ".3f")],
        ]
        lines += [*markdown_table(["balanced / equal, per repeat", "median [min - max]"], ratios), ""]
    return lines


def markdown(data: dict[str, Any]) -> list[str]:
    """Parts 1-3's page, from the flat view of :meth:`Cluster.view`."""
    setup = data["setup"]
    probes = ", ".join(f"{k}: {v:.0f} Mbit/s" if v else f"{k}: failed" for k, v in setup.get("probes", {}).items())
    lines = [
        title(data),
        "",
        f"**Setup.** A network-namespace cluster of 3 hosts on one bridge (host 0 and host 1: the workers; host 2: the"
        f" parameter server), built by `ds_lightning.testing.netns.Cluster`; one process per TF_CONFIG task, 1 thread"
        f" each, gloo, `Trainer(devices=1)`, no MASTER_ADDR/MASTER_PORT/GLOO_SOCKET_IFNAME in the environment (the pack"
        f" picks each task's interface). Links shaped on both directions of a host's veth by `Cluster.shape`"
        f" (qdisc: {setup.get('qdisc_kind', '?')}). Measured TCP throughput host 1 -> host 0 (one stream, Python"
        f" sockets): {probes or 'not probed'}. {data['repeats']} interleaved repeat(s); median [min - max] over"
        f" repeats, ratios taken per repeat. Total time {data['seconds'] / 60:.1f} min on a shared 2-core machine.",
        "",
    ]
    if data.get("compression") is not None:
        lines += part1_lines(data)
    return [*lines, *auto_lines(data), *uneven_lines(data), *data.get("notes", [])]


def plot(data: dict[str, Any], path: Path) -> None:
    """One bar chart per measured link of part 1 (labels: speed-up over none), then parts 2 and 3's."""
    comp = data.get("compression") or {}
    links = [link for link in LINKS if link["key"] in comp and link["key"] not in data["setup"]["unsupported"]]
    arms: dict[str, dict[str, Any]] = {}
    for link in links:
        for name, v in comp[link["key"]].items():
            arms.setdefault(name, {})[link["key"]] = v["step_ms"]
            arms[name][f"{link['key']}_speedup"] = v["speedup_over_none"]
    panels = [
        Panel(link["key"], f"1. {link['label']}: step, rank 0 (ms, log)", f"{link['key']}_speedup", True)
        for link in links
    ]
    if data.get("ps"):
        arms |= data["ps"]
        panels.append(Panel("samples_per_s", "2. samples/s, both workers", "throughput_over_mirrored"))
    if data.get("balance"):
        arms |= {n: data["balance"][n] for n in (EQUAL, BALANCED) if n in data["balance"]}
        panels.append(Panel("epoch_s", "3. epoch time, rank 0 (s)"))
    bar_panels(path, arms, panels, title(data).removeprefix("# "))


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
        same = [n for n, a in acc.items() if n != "none" and a.get("final_acc") == base["final_acc"]]
        moved = [n for n in same if acc[n].get("param_checksum") not in (None, base.get("param_checksum"))]
        if moved:
            out.append(
                f"- {', '.join(moved)} {'ends' if len(moved) == 1 else 'end'} with the same accuracy as none after"
                f" {data['acc_steps']} steps, but not the same parameters (sum of |parameters|: "
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
        if name == MIRRORED or not v.get("steps_w0") or not v.get("throughput_over_mirrored"):
            continue
        ratio = f"{v['throughput_over_mirrored']['median']:.2f}x ds_mirrored's."
        if not ps.get(MIRRORED, {}).get("step_ms_w0"):
            out.append(f"- {name}: throughput {ratio}")
            continue
        out.append(
            f"- {name}: worker 0 (fast link) ran {v['steps_w0']['median']:.0f} steps of"
            f" {v['step_ms_w0']['median']:.0f} ms, worker 1 (slow link) {v['steps_w1']['median']:.0f} of"
            f" {v['step_ms_w1']['median']:.0f} ms (a pull and a push of the whole model per step); under"
            f" ds_mirrored both wait for the slow link every step ({ps[MIRRORED]['step_ms_w0']['median']:.0f} ms)."
            f" Throughput {ratio}"
        )
    bal = data.get("balance") or {}
    v, e = bal.get(BALANCED) or {}, bal.get(EQUAL) or {}
    if v.get("final_share_rank0") and e.get("compute_ms_per_sample_r0") and e.get("step_ms"):
        share, r0, r1 = v["final_share_rank0"], e["compute_ms_per_sample_r0"], e["compute_ms_per_sample_r1"]
        out.append(
            "- DynamicLoadBalancer divides the batch by compute throughput, timed up to the launch of the last gradient"
            f" bucket, which leaves the all-reduce out. Under the equal split that compute was {r0['median']:.3f} /"
            f" {r1['median']:.3f} ms per sample on rank 0 / rank 1 (median), about"
            f" {r0['median'] * data['global_batch'] / WORKERS:.0f} ms per rank per step out of a"
            f" {e['step_ms']['median']:.0f} ms step: the all-reduce over the slow link dominates and waits for it"
            " whatever the split. So the balancer has no real imbalance to correct; its final rank-0 share was"
            f" {share['median']:.3f} [{share['min']:.3f} - {share['max']:.3f}] (following noise in the compute"
            " measurement on this shared machine) and the epoch time balanced / equal"
            f" {fmt(bal.get('ratio_epoch'), '.3f')}."
        )
    return ["**Notes**", "", *out] if out else []
