"""The pipeline benchmark's tables, charts and traces (``driver.py`` measures; this writes it up)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness.figures import save_figure
from ds_lightning.pipeline.trace import SpanRecorder, render_timeline_png, write_chrome_trace

SCHEDULES = ("GPipe", "1F1B")
IMPLS = ("hand", "ds")
LABELS = {"single": "single process", "hand": "hand-written loop", "ds": "ds_pipeline"}
TRACE_P, TRACE_M = 2, 8
TARGET = 1.05
DEFAULT_WORKLOAD = "8 x (Linear(512, 512) + ReLU), batch 128, MSE, SGD"


def config_key(impl: str, p: int, schedule: str, m: int) -> str:
    return f"{impl}|p{p}|{schedule}|m{m}"


def runs_of(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """One configuration's result in every repeat that got to it, in repeat order."""
    return [r["configs"][key] for r in sorted(records, key=lambda r: r["repeat"]) if key in r.get("configs", {})]


def expected_units(schedule: str, p: int, m: int, stage: int) -> int:
    """Micro-batches of activations a stage holds at its peak."""
    return m if schedule == "GPipe" else min(m, p - stage)


def _cell(v: dict[str, Any] | None, f: str = ".1f") -> str:
    return "failed" if v is None else harness.fmt(v, f)


def _rate(v: dict[str, Any] | None, per_step: int) -> str:
    """Throughput at the median step time: ``per_step`` samples or tokens per step."""
    return "failed" if v is None else f"{per_step * 1000 / v['median']:,.0f}"


def _stem(data: dict[str, Any]) -> str:
    return "pipeline_gpt" if data["settings"].get("model") == "gpt" else "pipeline"


def _title(what: str, s: dict[str, Any]) -> str:
    return "\n".join([what, *textwrap.wrap(_basis(s)[2], 110)])


def _basis(s: dict[str, Any]) -> tuple[int, str, str]:
    """Units per step, their name, and the workload's label (older JSON: the default model's)."""
    meta = s["meta"]
    return meta.get("per_step", 128), meta.get("unit", "samples"), meta.get("workload", DEFAULT_WORKLOAD)


def markdown(data: dict[str, Any]) -> list[str]:
    """The tables."""
    s = data["summary"]
    meta = {**data["settings"], **s["meta"], "seconds": data.get("seconds", 0), "cpus": data.get("cpus")}
    single = {int(m): v for m, v in s["single"].items()}
    base = single[1]["step_ms"]
    per_step, unit, workload = _basis(s)
    lines = [
        f"Workload: **{workload}** ({per_step:,} {unit} per step).",
        "",
        f"p CPU processes (gloo, 1 thread each) on a machine with"
        f" {meta['cpus']} cores; {meta['steps']} timed steps per configuration after {meta['warmup']} warm-up steps,"
        f" {meta['repeats']} interleaved repeat(s). Median over repeats of per-run medians [min - max]. Total run"
        f" {meta['seconds'] / 60:.1f} min.",
        "",
        f"Single process, whole batch: **{_cell(base, '.2f')} ms/step**, {_rate(base, per_step)} {unit}/s.",
        "",
        f"## Step time (ms) and throughput ({unit}/s)",
        "",
        "`single, m chunks` runs the m micro-batches one after another in one process (gradient accumulation): the"
        f" cost of micro-batching alone, without a pipeline. Throughput is {per_step:,} {unit} per step over the"
        " median step time.",
        "",
        "| p | schedule | m | single, m chunks | hand-written loop | ds_pipeline"
        f" | hand {unit}/s | ds_pipeline {unit}/s | ds / hand (target <= {TARGET}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in s["configs"]:
        ratio = c["ratio_ds_over_hand"]
        ratio_text = "n/a" if ratio is None else _cell(ratio, ".3f")
        if ratio is not None:
            ratio_text = f"**{ratio_text}** {harness.verdict(ratio, at_most=TARGET)}"
        chunks = single.get(c["m"], {}).get("step_ms")
        lines.append(
            f"| {c['p']} | {c['schedule']} | {c['m']} | {_cell(chunks)} | {_cell(c['hand']['step_ms'])}"
            f" | {_cell(c['ds']['step_ms'])} | {_rate(c['hand']['step_ms'], per_step)}"
            f" | {_rate(c['ds']['step_ms'], per_step)} | {ratio_text} |"
        )
    lines += [
        "",
        "## Bubble: measured from spans vs (p-1)/(m+p-1)",
        "",
        f"Measured: 1 - busy / (p x step length), median over steps 2-{meta['trace_steps'] + 1} (traced inside the"
        " discarded warm-up, so tracing never touches a timed step); a step runs from its first span's start to its"
        f" last span's end, so the optimizer step is outside. Traces of p={TRACE_P}, m={meta['trace_m']}:"
        f" `{_stem(data)}_trace_*.json` (Chrome / Perfetto) and `.png`.",
        "",
        "| p | schedule | m | formula | hand-written loop | ds_pipeline |",
        "|---|---|---|---|---|---|",
    ]
    for c in s["configs"]:
        lines.append(
            f"| {c['p']} | {c['schedule']} | {c['m']} | {c['bubble_formula']:.3f}"
            f" | {_cell(c['hand'].get('bubble'), '.3f')} | {_cell(c['ds'].get('bubble'), '.3f')} |"
        )
    lines += [
        "",
        "## Peak activation memory per stage",
        "",
        "Bytes saved for backward inside the model's layers (saved-tensor hooks, parameters excluded, a tensor saved"
        " twice counted once; what the loss saves is outside), peak over the timed steps, per stage (stage 0 /"
        " stage 1 / ...); units = one micro-batch's activations in that stage. Expected: GPipe m, 1F1B p - stage (at"
        f" most p). Chart: `{_stem(data)}_memory.png`.",
        "",
        "| p | schedule | m | hand: MB per stage | ds_pipeline: MB per stage | hand: units | ds_pipeline: units"
        " | expected units |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def units(entry: dict[str, Any]) -> str:
        return " / ".join(f"{u:.2f}" for u in entry["peak_units"].values()) if "peak_units" in entry else "failed"

    def mb(entry: dict[str, Any]) -> str:
        peaks = entry.get("peak_bytes")
        return " / ".join(f"{b / 2**20:.2f}" for b in peaks.values()) if peaks else "failed"

    for c in s["configs"]:
        expected = " / ".join(str(expected_units(c["schedule"], c["p"], c["m"], s)) for s in range(c["p"]))
        lines.append(
            f"| {c['p']} | {c['schedule']} | {c['m']} | {mb(c['hand'])} | {mb(c['ds'])} | {units(c['hand'])}"
            f" | {units(c['ds'])} | {expected} |"
        )
    single_mem = " / ".join(
        f"m={m}: {v['peak_bytes'][0] / 2**20:.2f} MB" for m, v in single.items() if "peak_bytes" in v
    )
    lines += ["", f"Single process peak activations: {single_mem}.", *_cpu_section(s, meta.get("cpus"))]
    failures = [
        f"- p={c['p']} {c['schedule']} m={c['m']} {LABELS[impl]}: {c[impl]['failed_runs']} failed repeat(s):"
        f" {'; '.join(dict.fromkeys(c[impl]['errors']))}"
        for c in s["configs"]
        for impl in IMPLS
        if c[impl]["failed_runs"]
    ]
    failures += [
        f"- single process m={m}: {v['failed_runs']} failed repeat(s): {'; '.join(dict.fromkeys(v['errors']))}"
        for m, v in single.items()
        if v["failed_runs"]
    ]
    if failures:
        lines += ["", "## Failures", "", *failures]
    return lines


def _cpu_section(s: dict[str, Any], cpus: int | None) -> list[str]:
    """CPU time per step, every rank's summed: where the ranks outnumber the cores, it bounds the step from below."""
    if not any(c[impl].get("cpu_ms") for c in s["configs"] for impl in IMPLS):
        return []  # results from before the CPU time was recorded
    single = s["single"]["1"] if "1" in s["single"] else s["single"].get(1, {})
    lines = [
        "",
        "## CPU time per step, all ranks together",
        "",
        "Each process's CPU time (every thread, gloo's included) from the first timed step's start to the last one's"
        " end, per step, summed over the ranks: the work between steps (Lightning's loop, the data loader) is inside."
        f" With more processes than the {cpus} cores, a step cannot be shorter than this sum / {cpus}."
        f" Single process, whole batch: {_cell(single.get('cpu_ms'))} ms.",
        "",
        f"| p | schedule | m | hand-written loop | ds_pipeline | ds - hand | ds - hand per rank | sum / {cpus} cores:"
        " hand | ds_pipeline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in s["configs"]:
        hand, ds = c["hand"].get("cpu_ms"), c["ds"].get("cpu_ms")
        diff = f"{ds['median'] - hand['median']:+.1f}" if hand and ds else "n/a"
        per_rank = f"{(ds['median'] - hand['median']) / c['p']:+.1f}" if hand and ds else "n/a"
        lines.append(
            f"| {c['p']} | {c['schedule']} | {c['m']} | {_cell(hand)} | {_cell(ds)} | {diff} | {per_rank}"
            f" | {_per_core(hand, cpus)} | {_per_core(ds, cpus)} |"
        )
    return lines


def _per_core(cpu: dict[str, Any] | None, cpus: int | None) -> str:
    return f"{cpu['median'] / cpus:.1f}" if cpu and cpus else "n/a"


def _pyplot() -> Any:
    import matplotlib  # here: running the benchmark needs no matplotlib until it writes

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_chart(data: dict[str, Any], path: Path) -> Path:
    """Step time against m, one panel per p."""
    s = data["summary"]
    plt = _pyplot()

    procs = s["meta"]["procs"]
    fig, axes = plt.subplots(1, len(procs), figsize=(max(8.0, 6.5 * len(procs)), 4.8), squeeze=False)
    styles = {
        ("hand", "GPipe"): ("tab:blue", "o", "-"),
        ("ds", "GPipe"): ("tab:blue", "s", "--"),
        ("hand", "1F1B"): ("tab:orange", "o", "-"),
        ("ds", "1F1B"): ("tab:orange", "s", "--"),
    }
    single = {int(m): v for m, v in s["single"].items()}
    for ax, p in zip(axes[0], procs, strict=True):
        for (impl, schedule), (colour, marker, line) in styles.items():
            points = [
                (c["m"], c[impl]["step_ms"])
                for c in s["configs"]
                if c["p"] == p and c["schedule"] == schedule and c[impl]["step_ms"] is not None
            ]
            if not points:
                continue
            ms = [m for m, _ in points]
            med = [v["median"] for _, v in points]
            err = [[v["median"] - v["min"] for _, v in points], [v["max"] - v["median"] for _, v in points]]
            ax.errorbar(
                ms,
                med,
                yerr=err,
                color=colour,
                marker=marker,
                linestyle=line,
                capsize=3,
                label=f"{LABELS[impl]} {schedule}",
            )
        chunks = [(m, v["step_ms"]["median"]) for m, v in sorted(single.items()) if v["step_ms"] is not None]
        if chunks:
            ax.plot([m for m, _ in chunks], [v for _, v in chunks], "k:", marker="^", label="single process, m chunks")
        if single[1]["step_ms"] is not None:
            ax.axhline(single[1]["step_ms"]["median"], color="grey", linewidth=0.8, label="single process, whole batch")
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["meta"]["ms"], [str(m) for m in s["meta"]["ms"]])
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("median step time (ms)")
        ax.set_title(f"p = {p} stages (CPU processes), min-max over repeats")
        ax.legend(fontsize=8)
    fig.suptitle(_title("ds_pipeline vs hand-written torch pipelining", s), fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def write_memory_chart(data: dict[str, Any], path: Path) -> Path:
    """ds_pipeline's peak activation memory per stage, one line per (schedule, m), one panel per p; the single
    process's whole-batch peak for scale."""
    s = data["summary"]
    plt = _pyplot()
    procs, ms = s["meta"]["procs"], s["meta"]["ms"]
    fig, axes = plt.subplots(1, len(procs), figsize=(max(8.0, 6.5 * len(procs)), 4.8), squeeze=False)
    colours = {"GPipe": plt.get_cmap("Blues"), "1F1B": plt.get_cmap("Oranges")}
    whole = s["single"].get(1, s["single"].get("1", {})).get("peak_bytes")
    for ax, p in zip(axes[0], procs, strict=True):
        for c in s["configs"]:
            peaks = c["ds"].get("peak_bytes")
            if c["p"] != p or not peaks:
                continue
            shade = colours[c["schedule"]](0.35 + 0.6 * ms.index(c["m"]) / max(1, len(ms) - 1))
            stages = [int(k) for k in peaks]
            style = "-" if c["schedule"] == "GPipe" else "--"
            mb = [b / 2**20 for b in peaks.values()]
            ax.plot(stages, mb, style, color=shade, marker="o", label=f"{c['schedule']} m={c['m']}")
        if whole:
            ax.axhline(
                next(iter(whole.values())) / 2**20, color="grey", linewidth=0.8, label="one process, whole batch"
            )
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.3)  # room for the legend above the lines
        ax.set_xticks(range(p))
        ax.set_xlabel("stage")
        ax.set_ylabel("peak activations saved for backward (MB)")
        ax.set_title(f"ds_pipeline, p = {p} stages")
        ax.legend(fontsize=7, ncol=3, loc="upper center")
    fig.suptitle(_title("Peak activation memory per stage", s), fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def write_traces(records: list[dict[str, Any]], m: int, out: Path, stem: str = "pipeline") -> list[Path]:
    """The last good run's spans at p=TRACE_P and m: a Chrome trace and a PNG timeline per implementation, schedule."""
    written = []
    for impl in IMPLS:
        for schedule in SCHEDULES:
            key = config_key(impl, TRACE_P, schedule, m)
            runs = [c for c in runs_of(records, key) if "error" not in c and c.get("spans")]
            if not runs:
                continue
            spans = SpanRecorder.from_payload(runs[-1]["spans"])
            base = out / f"{stem}_trace_{impl}_{schedule}"
            write_chrome_trace(spans, base.with_suffix(".json"))
            render_timeline_png(spans, base.with_suffix(".png"), title=f"{LABELS[impl]} {schedule}, p={TRACE_P}, m={m}")
            written += [base.with_suffix(".json"), base.with_suffix(".png")]
    return written
