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
#: the hand-written loop's schedule called from a Lightning Trainer's training_step: Lightning's own cost, apart
FLOOR = "lightning"
LABELS = {
    "single": "single process",
    "hand": "hand-written loop",
    FLOOR: "hand-written loop in Lightning",
    "ds": "ds_pipeline",
}
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


def _per_stage(entry: dict[str, Any], key: str, f: str) -> str:
    return " / ".join(f"{v:{f}}" for v in entry[key].values()) if entry.get(key) else "failed"


def _difference(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    return f"{a['median'] - b['median']:+.1f}" if a and b else "n/a"


def _rows(c: dict[str, Any], single: dict[int, Any]) -> tuple[list[Any], ...]:
    """One configuration's row in each table: step time, bubble, memory, CPU."""
    head, (hand, ds), floor = [c["p"], c["schedule"], c["m"]], (c[i] for i in IMPLS), c.get(FLOOR, {})
    ratios = (c["ratio_ds_over_hand"], c.get("ratio_ds_over_lightning"))
    bare, in_pl = (f"**{_cell(r, '.3f')}** {harness.verdict(r, at_most=TARGET)}" if r else "n/a" for r in ratios)
    # GPipe holds all m micro-batches, 1F1B at most p - stage
    expected = " / ".join(str(c["m"] if c["schedule"] == "GPipe" else min(c["m"], c["p"] - i)) for i in range(c["p"]))
    mb = " / ".join(f"{b / 2**20:.2f}" for b in ds["peak_bytes"].values()) if ds.get("peak_bytes") else "failed"
    cpu = [hand.get("cpu_ms"), floor.get("cpu_ms"), ds.get("cpu_ms")]
    steps = (_cell(v.get("step_ms")) for v in (single.get(c["m"], {}), hand, floor, ds))
    return (
        [*head, *steps, bare, in_pl],
        [*head, f"{c['bubble_formula']:.3f}", *(_cell(c[i].get("bubble"), ".3f") for i in IMPLS)],
        [*head, mb, _per_stage(hand, "peak_units", ".2f"), _per_stage(ds, "peak_units", ".2f"), expected],
        [*head, *map(_cell, cpu), *(_difference(cpu[2], b) for b in cpu[:2])],
    )


def markdown(data: dict[str, Any]) -> list[str]:
    s, st = data["summary"], data["settings"]
    meta, configs, single = s["meta"], s["configs"], {int(m): v for m, v in s["single"].items()}
    base = single[1]["step_ms"]
    steps, bubbles, memory, cpu = (list(t) for t in zip(*(_rows(c, single) for c in configs), strict=True))
    head = ["p", "schedule", "m"]
    lines = [
        f"Workload: **{meta['workload']}** ({meta['per_step']:,} {meta['unit']} per step); p CPU processes on"
        f" {data.get('cpus')} cores, {st['steps']} timed steps after {st['warmup']} warm-up, {st['repeats']}"
        " interleaved repeat(s); median over repeats [min - max]. Method: [the README](../pipeline/README.md).",
        "",
        f"Single process, whole batch: **{_cell(base, '.2f')} ms/step**,"
        f" {meta['per_step'] * 1000 / base['median']:,.0f} {meta['unit']}/s."
        if base
        else "",
        "",
        "## Step time (ms)",
        "",
        *harness.markdown_table(
            [
                *head,
                "single, m chunks",
                "hand-written loop",
                "hand-written, in Lightning",
                "ds_pipeline",
                f"ds / hand (<= {TARGET})",
                f"ds / hand in Lightning (<= {TARGET})",
            ],
            steps,
        ),
        "",
        "*Hand-written, in Lightning*: the hand-written loop's stage and schedule called from a Lightning Trainer's"
        " `training_step` (manual optimization, the module not wrapped): Lightning's own loop around the same"
        " pipeline, so ds / that ratio is what ds_pipeline adds to it.",
        "",
        "## Bubble: measured from spans vs (p-1)/(m+p-1)",
        "",
        *harness.markdown_table([*head, "formula", "hand-written loop", "ds_pipeline"], bubbles),
        "",
        "## Peak activation memory per stage",
        "",
        "Per stage (stage 0 / stage 1 / ...); units = one micro-batch's activations in that stage.",
        "",
        *harness.markdown_table(
            [*head, "ds_pipeline: MB", "hand: units", "ds_pipeline: units", "expected units"], memory
        ),
        "",
        "## CPU time per step, all ranks together",
        "",
        f"ms per step, summed over the ranks; single process, whole batch: {_cell(single[1].get('cpu_ms'))} ms.",
        "",
        *harness.markdown_table(
            [*head, "hand-written loop", "hand-written, in Lightning", "ds_pipeline", "ds - hand", "ds - in Lightning"],
            cpu,
        ),
    ]
    where = [
        (f"p={c['p']} {c['schedule']} m={c['m']} {LABELS[i]}", c[i]) for c in configs for i in (*IMPLS, FLOOR) if i in c
    ]
    failures = [
        f"- {w}: {v['failed_runs']} failed repeat(s): {'; '.join(dict.fromkeys(v['errors']))}"
        for w, v in [*where, *((f"single process m={m}", v) for m, v in single.items())]
        if v["failed_runs"]
    ]
    return [*lines, *(["", "## Failures", "", *failures] if failures else [])]


def step_chart(data: dict[str, Any], path: Path) -> Path:
    """Step time against m, one panel per p."""
    import matplotlib  # here: running the benchmark needs no matplotlib until it writes

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["summary"]
    procs = s["meta"]["procs"]
    fig, axes = plt.subplots(1, len(procs), figsize=(max(8.0, 6.5 * len(procs)), 4.8), squeeze=False)
    what = "ds_pipeline vs hand-written torch pipelining"
    fig.suptitle("\n".join([what, *textwrap.wrap(s["meta"]["workload"], 110)]), fontsize=10)
    single = {int(m): v["step_ms"] for m, v in s["single"].items()}
    for ax, p in zip(axes[0], procs, strict=True):
        for impl, schedule in ((i, sch) for sch in SCHEDULES for i in IMPLS):
            points = [(c["m"], c[impl]["step_ms"]) for c in s["configs"] if (c["p"], c["schedule"]) == (p, schedule)]
            if points := [(m, v) for m, v in points if v is not None]:
                ms, med = [m for m, _ in points], [v["median"] for _, v in points]
                err = [[v["median"] - v["min"] for _, v in points], [v["max"] - v["median"] for _, v in points]]
                style = {"color": "tab:blue" if schedule == "GPipe" else "tab:orange", "capsize": 3}
                style.update(marker="o" if impl == "hand" else "s", linestyle="-" if impl == "hand" else "--")
                ax.errorbar(ms, med, yerr=err, label=f"{LABELS[impl]} {schedule}", **style)
        if chunks := [(m, v["median"]) for m, v in sorted(single.items()) if v is not None]:
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


def write_traces(records: list[dict[str, Any]], m: int, out: Path, stem: str) -> list[Path]:
    """A Chrome trace and a PNG timeline per implementation and schedule, from the traced run at p=TRACE_P and m."""
    written = []
    for impl, schedule in ((i, s) for i in IMPLS for s in SCHEDULES):
        if run := traced_run(records, impl, schedule, m):
            spans, base = SpanRecorder.from_payload(run["spans"]), out / f"{stem}_trace_{impl}_{schedule}"
            write_chrome_trace(spans, base.with_suffix(".json"))
            render_timeline_png(spans, base.with_suffix(".png"), title=f"{LABELS[impl]} {schedule}, p={TRACE_P}, m={m}")
            written += [base.with_suffix(".json"), base.with_suffix(".png")]
    return written
