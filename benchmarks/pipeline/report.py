"""The pipeline benchmark's tables, charts and traces, from the summary and the records (see README.md)."""

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


def config_key(impl: str, p: int, schedule: str, m: int) -> str:
    return f"{impl}|p{p}|{schedule}|m{m}"


def runs_of(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """One configuration's result in every repeat that got to it, in repeat order."""
    return [r["configs"][key] for r in sorted(records, key=lambda r: r["repeat"]) if key in r.get("configs", {})]


def traced_run(records: list[dict[str, Any]], impl: str, schedule: str, m: int) -> dict[str, Any] | None:
    """The run the traces are drawn from: the last good one with spans at p=TRACE_P."""
    runs = [c for c in runs_of(records, config_key(impl, TRACE_P, schedule, m)) if "error" not in c and c.get("spans")]
    return runs[-1] if runs else None


def _cell(v: dict[str, Any] | None, f: str = ".1f") -> str:
    return "failed" if v is None else harness.fmt(v, f)


def _rate(v: dict[str, Any] | None, per_step: int) -> str:
    return "failed" if v is None else f"{per_step * 1000 / v['median']:,.0f}"


def _per_stage(entry: dict[str, Any], key: str, f: Any) -> str:
    return " / ".join(f(v) for v in entry[key].values()) if entry.get(key) else "failed"


def markdown(data: dict[str, Any]) -> list[str]:
    s, st = data["summary"], data["settings"]
    meta, cpus = s["meta"], data.get("cpus")
    single = {int(m): v for m, v in s["single"].items()}
    per_step, unit, base = meta["per_step"], meta["unit"], single[1]["step_ms"]
    stem = "pipeline_gpt" if st.get("model") == "gpt" else "pipeline"
    configs = s["configs"]

    def head(c: dict[str, Any]) -> list[Any]:
        return [c["p"], c["schedule"], c["m"]]

    def ratio(c: dict[str, Any]) -> str:
        r = c["ratio_ds_over_hand"]
        return "n/a" if r is None else f"**{_cell(r, '.3f')}** {harness.verdict(r, at_most=TARGET)}"

    step_rows = [
        [
            *head(c),
            _cell(single.get(c["m"], {}).get("step_ms")),
            _cell(c["hand"]["step_ms"]),
            _cell(c["ds"]["step_ms"]),
            _rate(c["hand"]["step_ms"], per_step),
            _rate(c["ds"]["step_ms"], per_step),
            ratio(c),
        ]
        for c in configs
    ]
    bubble_rows = [
        [
            *head(c),
            f"{c['bubble_formula']:.3f}",
            _cell(c["hand"].get("bubble"), ".3f"),
            _cell(c["ds"].get("bubble"), ".3f"),
        ]
        for c in configs
    ]
    mb, units = (lambda b: f"{b / 2**20:.2f}"), (lambda u: f"{u:.2f}")
    memory_rows = [
        [
            *head(c),
            _per_stage(c["hand"], "peak_bytes", mb),
            _per_stage(c["ds"], "peak_bytes", mb),
            _per_stage(c["hand"], "peak_units", units),
            _per_stage(c["ds"], "peak_units", units),
            " / ".join(str(c["m"] if c["schedule"] == "GPipe" else min(c["m"], c["p"] - i)) for i in range(c["p"])),
        ]
        for c in configs
    ]
    single_mem = " / ".join(
        f"m={m}: {v['peak_bytes'][0] / 2**20:.2f} MB" for m, v in single.items() if "peak_bytes" in v
    )
    lines = [
        f"Workload: **{meta['workload']}** ({per_step:,} {unit} per step).",
        "",
        f"p CPU processes (gloo, 1 thread each) on a machine with {cpus} cores; {st['steps']} timed steps per"
        f" configuration after {st['warmup']} warm-up steps, {st['repeats']} interleaved repeat(s). Median over"
        f" repeats of per-run medians [min - max]. Total run {data.get('seconds', 0) / 60:.1f} min.",
        "",
        f"Single process, whole batch: **{_cell(base, '.2f')} ms/step**, {_rate(base, per_step)} {unit}/s.",
        "",
        f"## Step time (ms) and throughput ({unit}/s)",
        "",
        "`single, m chunks` runs the m micro-batches one after another in one process (gradient accumulation): the"
        f" cost of micro-batching alone, without a pipeline. Throughput is {per_step:,} {unit} per step over the"
        " median step time.",
        "",
        *harness.markdown_table(
            [
                "p",
                "schedule",
                "m",
                "single, m chunks",
                "hand-written loop",
                "ds_pipeline",
                f"hand {unit}/s",
                f"ds_pipeline {unit}/s",
                f"ds / hand (target <= {TARGET})",
            ],
            step_rows,
        ),
        "",
        "## Bubble: measured from spans vs (p-1)/(m+p-1)",
        "",
        f"Measured: 1 - busy / (p x step length), median over steps 2-{st['trace_steps'] + 1} (traced inside the"
        " discarded warm-up, so tracing never touches a timed step); a step runs from its first span's start to its"
        f" last span's end, so the optimizer step is outside. Traces of p={TRACE_P}, m={meta['trace_m']}:"
        f" `{stem}_trace_*.json` (Chrome / Perfetto) and `.png`.",
        "",
        *harness.markdown_table(["p", "schedule", "m", "formula", "hand-written loop", "ds_pipeline"], bubble_rows),
        "",
        "## Peak activation memory per stage",
        "",
        "Bytes saved for backward inside the model's layers (saved-tensor hooks, parameters excluded, a tensor saved"
        " twice counted once; what the loss saves is outside), peak over the timed steps, per stage (stage 0 /"
        " stage 1 / ...); units = one micro-batch's activations in that stage. Expected: GPipe m, 1F1B p - stage (at"
        f" most p). Chart: `{stem}_memory.png`.",
        "",
        *harness.markdown_table(
            [
                "p",
                "schedule",
                "m",
                "hand: MB per stage",
                "ds_pipeline: MB per stage",
                "hand: units",
                "ds_pipeline: units",
                "expected units",
            ],
            memory_rows,
        ),
        "",
        f"Single process peak activations: {single_mem}.",
        "",
        "## CPU time per step, all ranks together",
        "",
        "Each process's CPU time (every thread, gloo's included) from the first timed step's start to the last one's"
        " end, per step, summed over the ranks: the work between steps (Lightning's loop, the data loader) is inside."
        f" With more processes than the {cpus} cores, a step cannot be shorter than this sum / {cpus}."
        f" Single process, whole batch: {_cell(single[1].get('cpu_ms'))} ms.",
        "",
        *harness.markdown_table(
            [
                "p",
                "schedule",
                "m",
                "hand-written loop",
                "ds_pipeline",
                "ds - hand",
                "ds - hand per rank",
                f"sum / {cpus} cores: hand",
                "ds_pipeline",
            ],
            [_cpu_row(c, cpus) for c in configs],
        ),
    ]
    failures = [
        f"- {where}: {v['failed_runs']} failed repeat(s): {'; '.join(dict.fromkeys(v['errors']))}"
        for where, v in [
            *((f"p={c['p']} {c['schedule']} m={c['m']} {LABELS[i]}", c[i]) for c in configs for i in IMPLS),
            *((f"single process m={m}", v) for m, v in single.items()),
        ]
        if v["failed_runs"]
    ]
    return [*lines, *(["", "## Failures", "", *failures] if failures else [])]


def _cpu_row(c: dict[str, Any], cpus: int) -> list[Any]:
    hand, ds = c["hand"].get("cpu_ms"), c["ds"].get("cpu_ms")
    diff = ds["median"] - hand["median"] if hand and ds else None
    per_core = [f"{v['median'] / cpus:.1f}" if v else "n/a" for v in (hand, ds)]
    extra = [f"{diff:+.1f}", f"{diff / c['p']:+.1f}"] if diff is not None else ["n/a", "n/a"]
    return [c["p"], c["schedule"], c["m"], _cell(hand), _cell(ds), *extra, *per_core]


def _panels(data: dict[str, Any], what: str) -> tuple[Any, Any, dict[str, Any]]:
    """A figure with one panel per p, titled with what it shows and the workload."""
    import matplotlib  # here: running the benchmark needs no matplotlib until it writes

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["summary"]
    procs = s["meta"]["procs"]
    fig, axes = plt.subplots(1, len(procs), figsize=(max(8.0, 6.5 * len(procs)), 4.8), squeeze=False)
    fig.suptitle("\n".join([what, *textwrap.wrap(s["meta"]["workload"], 110)]), fontsize=10)
    return fig, zip(axes[0], procs, strict=True), s


def step_chart(data: dict[str, Any], path: Path) -> Path:
    """Step time against m, one panel per p."""
    fig, panels, s = _panels(data, "ds_pipeline vs hand-written torch pipelining")
    single = {int(m): v["step_ms"] for m, v in s["single"].items()}
    for ax, p in panels:
        for impl, schedule in ((i, sch) for sch in SCHEDULES for i in IMPLS):
            points = [(c["m"], c[impl]["step_ms"]) for c in s["configs"] if c["p"] == p and c["schedule"] == schedule]
            points = [(m, v) for m, v in points if v is not None]
            if points:
                ms, med = [m for m, _ in points], [v["median"] for _, v in points]
                err = [[v["median"] - v["min"] for _, v in points], [v["max"] - v["median"] for _, v in points]]
                style = {"color": "tab:blue" if schedule == "GPipe" else "tab:orange", "capsize": 3}
                style.update(marker="o" if impl == "hand" else "s", linestyle="-" if impl == "hand" else "--")
                ax.errorbar(ms, med, yerr=err, label=f"{LABELS[impl]} {schedule}", **style)
        chunks = [(m, v["median"]) for m, v in sorted(single.items()) if v is not None]
        if chunks:
            ax.plot([m for m, _ in chunks], [v for _, v in chunks], "k:", marker="^", label="single process, m chunks")
        if single[1] is not None:
            ax.axhline(single[1]["median"], color="grey", linewidth=0.8, label="single process, whole batch")
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["meta"]["ms"], [str(m) for m in s["meta"]["ms"]])
        ax.set(xlabel="micro-batches m", ylabel="median step time (ms)")
        ax.set_title(f"p = {p} stages (CPU processes), min-max over repeats")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def memory_chart(data: dict[str, Any], path: Path) -> Path:
    """ds_pipeline's peak activation memory per stage, a line per (schedule, m), a panel per p; the single process's
    whole-batch peak for scale."""
    import matplotlib.pyplot as plt

    fig, panels, s = _panels(data, "Peak activation memory per stage")
    ms = s["meta"]["ms"]
    whole = s["single"][1].get("peak_bytes")
    for ax, p in panels:
        for c in (c for c in s["configs"] if c["p"] == p and c["ds"].get("peak_bytes")):
            peaks = c["ds"]["peak_bytes"]
            shade = plt.get_cmap("Blues" if c["schedule"] == "GPipe" else "Oranges")
            color = shade(0.35 + 0.6 * ms.index(c["m"]) / max(1, len(ms) - 1))
            style = "-" if c["schedule"] == "GPipe" else "--"
            mb = [b / 2**20 for b in peaks.values()]
            ax.plot([int(k) for k in peaks], mb, style, color=color, marker="o", label=f"{c['schedule']} m={c['m']}")
        if whole:
            ax.axhline(
                next(iter(whole.values())) / 2**20, color="grey", linewidth=0.8, label="one process, whole batch"
            )
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.3)  # room for the legend above the lines
        ax.set_xticks(range(p))
        ax.set(xlabel="stage", ylabel="peak activations saved for backward (MB)", title=f"ds_pipeline, p = {p} stages")
        ax.legend(fontsize=7, ncol=3, loc="upper center")
    fig.tight_layout()
    save_figure(fig, path)
    return path


def write_traces(records: list[dict[str, Any]], m: int, out: Path, stem: str) -> list[Path]:
    """A Chrome trace and a PNG timeline per implementation and schedule, from the traced run at p=TRACE_P and m."""
    written = []
    for impl in IMPLS:
        for schedule in SCHEDULES:
            run = traced_run(records, impl, schedule, m)
            if run:
                spans, base = SpanRecorder.from_payload(run["spans"]), out / f"{stem}_trace_{impl}_{schedule}"
                write_chrome_trace(spans, base.with_suffix(".json"))
                title = f"{LABELS[impl]} {schedule}, p={TRACE_P}, m={m}"
                render_timeline_png(spans, base.with_suffix(".png"), title=title)
                written += [base.with_suffix(".json"), base.with_suffix(".png")]
    return written
