"""How close is ds_pipeline to a hand-written torch.distributed.pipelining loop, and what do micro-batching and the
schedule do on CPU?

Model: 8 blocks of Linear(512, 512) + ReLU, batch 128 of fixed random data, MSE loss, SGD. For GPipe and 1F1B, m
micro-batches (1, 2, 4, 8, 16; 1F1B needs m >= p) and p processes = stages (2, 4), it measures the median step time of
(a) ds_pipeline under a Lightning Trainer and (b) a hand-written loop with the same torch schedule, against one process
doing forward + backward + step (also over m sequential chunks, which isolates the cost of micro-batching). Every
configuration of one (implementation, p) runs inside one launch of p processes (gloo, 1 thread each), an arm of the
benchmark harness, which interleaves the launches repeat by repeat. It also measures the bubble from traced spans (next
to the formula (p-1)/(m+p-1)) and the peak activation memory per stage, counted with saved-tensor hooks (in units of one
micro-batch's activations).

Besides ``pipeline.json/.md/.png`` it writes, for p=2 and m=8, a Chrome trace and a PNG timeline per schedule and
implementation (``pipeline_trace_<impl>_<schedule>.json/.png``).

    python benchmarks/pipeline.py [--quick] [--repeats 3] [--out DIR] [--render [JSON]] [--steps 40] [--warmup 5]
        [--procs 2 4] [--ms 1 2 4 8 16] [--timeout 600] [--dist-timeout 120]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment
from ds_lightning.pipeline.trace import SpanRecorder, bubble_fraction, render_timeline_png, write_chrome_trace

WORKER = Path(__file__).resolve().parent / "_pipeline_worker.py"
SCHEDULES = ("GPipe", "1F1B")
IMPLS = ("hand", "ds")
LABELS = {"single": "single process", "hand": "hand-written loop", "ds": "ds_pipeline"}
TRACE_P, TRACE_M = 2, 8
TARGET = 1.05


def config_key(impl: str, p: int, schedule: str, m: int) -> str:
    return f"{impl}|p{p}|{schedule}|m{m}"


def _merge(lines: list[dict[str, Any]], procs: int) -> dict[str, dict[str, Any]]:
    """Per-rank records of one launch, merged per configuration; only rank 0's step times count, and a configuration
    counts as done only when every rank finished it."""
    merged: dict[str, dict[str, Any]] = {}
    for line in lines:
        entry = merged.setdefault(line["key"], {"peak_bytes": {}, "unit_bytes": {}, "spans": [], "ranks": 0})
        entry["ranks"] += 1
        entry["peak_bytes"].update(line["peak_bytes"])
        entry["unit_bytes"].update(line["unit_bytes"])
        entry["spans"] += line.get("spans", [])
        if line["rank"] == 0:
            entry["median_step_ms"] = line["median_step_ms"]
            entry["step_ms"] = line["step_ms"]
    return {key: entry for key, entry in merged.items() if "median_step_ms" in entry and entry["ranks"] == procs}


def run_launches(impl: str, p: int, configs: list[dict[str, Any]], opts: argparse.Namespace) -> dict[str, Any]:
    """Run all ``configs`` in as few launches as possible; a configuration that fails or hangs is recorded as failed
    and the launch is restarted from the next one."""
    results: dict[str, dict[str, Any]] = {}
    remaining = list(configs)
    while remaining:
        spec = {"impl": impl, "procs": p, "configs": remaining, "seed": 0, "dist_timeout": opts.dist_timeout}
        spec.update(warmup=opts.warmup, steps=opts.steps, trace_steps=opts.trace_steps)
        try:
            found, _, log = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1), outputs="rank*.jsonl")
        except harness.Failed as exc:
            found, log = exc.found, exc.log
        rc = found.get("rc")
        merged = _merge([line for k, v in found.items() if k != "rc" for line in v], p)
        results.update({c["key"]: merged[c["key"]] for c in remaining if c["key"] in merged})
        remaining = [c for c in remaining if c["key"] not in merged]
        if not remaining:
            break
        failed = remaining.pop(0)  # configurations run in order: the first one missing is where it stopped
        reason = f"timed out after {opts.timeout:.0f} s" if rc == "timeout" else f"exit code {rc}"
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in log.splitlines()]
        errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Timeout)\b", line)]
        if errors:
            reason += f", {errors[-1][:300]}"
        results[failed["key"]] = {"error": reason, "log_tail": log[-1500:]}
        print(f"  FAILED {failed['key']}: {reason}; log tail:\n{log[-1500:]}", flush=True)
    return results


def runs_of(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """One configuration's result in every repeat that got to it, in repeat order."""
    return [r["configs"][key] for r in sorted(records, key=lambda r: r["repeat"]) if key in r.get("configs", {})]


def step_by_repeat(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    """One configuration's median step time by repeat, where it ran."""
    return {
        r["repeat"]: r["configs"][key]["median_step_ms"]
        for r in records
        if "median_step_ms" in r.get("configs", {}).get(key, {})
    }


def summarise_config(records: list[dict[str, Any]], key: str) -> dict[str, Any]:
    runs = runs_of(records, key)
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {
        "step_ms": harness.spread(r["median_step_ms"] for r in ok),
        "failed_runs": len(runs) - len(ok),
    }
    if ok:
        last = ok[-1]
        out["peak_bytes"] = {int(s): b for s, b in sorted(last["peak_bytes"].items(), key=lambda kv: int(kv[0]))}
        out["unit_bytes"] = {int(s): b for s, b in sorted(last["unit_bytes"].items(), key=lambda kv: int(kv[0]))}
        out["peak_units"] = {s: out["peak_bytes"][s] / out["unit_bytes"][s] for s in out["peak_bytes"]}
        out["bubble"] = harness.spread(bubble(r["spans"]) for r in ok)
    if len(ok) < len(runs):
        out["errors"] = [r["error"] for r in runs if "error" in r]
    return out


def bubble(spans: list[list[Any]]) -> float | None:
    """The median over ranks of the idle share of a step, from traced spans."""
    if not spans:
        return None
    fractions = bubble_fraction(SpanRecorder.from_payload(spans))
    return statistics.median(fractions.values()) if fractions else None


def formula(p: int, m: int) -> float:
    """The bubble's textbook share."""
    return (p - 1) / (m + p - 1)


def expected_units(schedule: str, p: int, m: int, stage: int) -> int:
    """Micro-batches of activations a stage holds at its peak."""
    return m if schedule == "GPipe" else min(m, p - stage)


def _cell(v: dict[str, Any] | None, f: str = ".1f") -> str:
    return "failed" if v is None else harness.fmt(v, f)


def pipe_configs(p: int, ms: list[int]) -> list[dict[str, Any]]:
    """Every (schedule, m) for p stages; 1F1B needs n_microbatches >= stages."""
    return [{"schedule": s, "m": m} for s in SCHEDULES for m in ms if not (s == "1F1B" and m < p)]


class Pipeline(harness.Benchmark):
    name = "pipeline"
    description = __doc__
    defaults = {"repeats": 3, "steps": 40, "warmup": 5, "procs": [2, 4], "ms": [1, 2, 4, 8, 16], "trace_steps": 3}
    quick = {"repeats": 1, "steps": 5, "warmup": 3, "procs": [2], "ms": [2, 4], "trace_steps": 2}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (40)")
        parser.add_argument("--warmup", type=int, default=None, help="discarded steps first (5)")
        parser.add_argument("--procs", type=int, nargs="+", default=None, help="processes = stages (2 4)")
        parser.add_argument("--ms", type=int, nargs="+", default=None, help="micro-batch counts (1 2 4 8 16)")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take (600)")
        parser.add_argument("--dist-timeout", type=int, default=120, help="seconds a collective may wait (120)")
        parser.add_argument("--trace-steps", type=int, default=None, help=argparse.SUPPRESS)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        opts.procs, opts.ms = sorted(opts.procs), sorted(opts.ms)
        bad = [p for p in opts.procs if p < 2 or 8 % p] + [m for m in opts.ms if m < 1 or 128 % m]
        if bad:
            raise SystemExit(f"{bad}: p must divide the 8 blocks (2, 4, 8) and m the batch of 128")
        # Traced steps are steps 1..trace_steps (after one skipped), kept inside the discarded warm-up.
        opts.warmup = max(opts.warmup, opts.trace_steps + 1)
        return {"cpus": os.cpu_count(), "model": "8 x (Linear(512, 512) + ReLU), batch 128, MSE, SGD(lr=0.01)"}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [Arm("single", {"impl": "single", "p": 1}, LABELS["single"])]
        arms += [
            Arm(f"{impl} p={p}", {"impl": impl, "p": p}, f"{LABELS[impl]}, p={p}") for p in opts.procs for impl in IMPLS
        ]
        return Experiment(arms, opts.repeats)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        impl, p = arm.params["impl"], arm.params["p"]
        if impl == "single":
            configs = [{"schedule": "seq", "m": m} for m in sorted({1, *opts.ms})]
        else:
            configs = pipe_configs(p, opts.ms)
        configs = [{**c, "key": config_key(impl, p, c["schedule"], c["m"])} for c in configs]
        return {"configs": run_launches(impl, p, configs, opts)}

    def progress(self, record: dict[str, Any]) -> str:
        return ", ".join(
            f"{k.split('|', 2)[2]}: " + (f"{v['median_step_ms']:.1f}" if "error" not in v else "FAILED")
            for k, v in record["configs"].items()
        )

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        st, records = data["settings"], data["records"]
        procs, ms = sorted(st["procs"]), sorted(st["ms"])
        trace_m = TRACE_M if TRACE_M in ms else max(ms)
        single = {m: summarise_config(records, config_key("single", 1, "seq", m)) for m in sorted({1, *ms})}
        configs = []
        for p in procs:
            for c in pipe_configs(p, ms):
                s, m = c["schedule"], c["m"]
                entry: dict[str, Any] = {"p": p, "schedule": s, "m": m, "bubble_formula": formula(p, m)}
                for impl in IMPLS:
                    entry[impl] = summarise_config(records, config_key(impl, p, s, m))
                hand, ds = (step_by_repeat(records, config_key(impl, p, s, m)) for impl in IMPLS)
                entry["ratio_ds_over_hand"] = harness.spread(ds[k] / hand[k] for k in sorted(set(hand) & set(ds)))
                configs.append(entry)
        meta = {"procs": procs, "ms": ms, "trace_m": trace_m}
        return {"meta": meta, "single": single, "configs": configs}

    def report(self, data: dict[str, Any]) -> list[str]:
        return markdown(data)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        write_chart(data, out)
        return [out / "pipeline.png", *write_traces(data["records"], data["summary"]["meta"]["trace_m"], out)]


def markdown(data: dict[str, Any]) -> list[str]:
    """The tables."""
    s = data["summary"]
    meta = {**data["settings"], **s["meta"], "seconds": data.get("seconds", 0), "cpus": data.get("cpus")}
    single = {int(m): v for m, v in s["single"].items()}
    base = single[1]["step_ms"]
    lines = [
        f"8 x (Linear(512, 512) + ReLU), batch 128, MSE, SGD; p CPU processes (gloo, 1 thread each) on a machine with"
        f" {meta['cpus']} cores; {meta['steps']} timed steps per configuration after {meta['warmup']} warm-up steps,"
        f" {meta['repeats']} interleaved repeat(s). Median over repeats of per-run medians [min - max]. Total run"
        f" {meta['seconds'] / 60:.1f} min.",
        "",
        f"Single process, whole batch: **{_cell(base, '.2f')} ms/step**.",
        "",
        "## Step time (ms)",
        "",
        "`single, m chunks` runs the m micro-batches one after another in one process (gradient accumulation): the"
        " cost of micro-batching alone, without a pipeline.",
        "",
        f"| p | schedule | m | single, m chunks | hand-written loop | ds_pipeline | ds / hand (target <= {TARGET}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in s["configs"]:
        ratio = c["ratio_ds_over_hand"]
        ratio_text = "n/a" if ratio is None else _cell(ratio, ".3f")
        if ratio is not None:
            ratio_text = f"**{ratio_text}**" + ("" if ratio["median"] <= TARGET else " (above target)")
        chunks = single.get(c["m"], {}).get("step_ms")
        lines.append(
            f"| {c['p']} | {c['schedule']} | {c['m']} | {_cell(chunks)} | {_cell(c['hand']['step_ms'])}"
            f" | {_cell(c['ds']['step_ms'])} | {ratio_text} |"
        )
    lines += [
        "",
        "## Bubble: measured from spans vs (p-1)/(m+p-1)",
        "",
        f"Measured: 1 - busy / (p x step length), median over steps 2-{meta['trace_steps'] + 1} (traced inside the"
        " discarded warm-up, so tracing never touches a timed step); a step runs from its first span's start to its"
        f" last span's end, so the optimizer step is outside. Traces of p={TRACE_P}, m={meta['trace_m']}:"
        " `pipeline_trace_*.json` (Chrome / Perfetto) and `.png`.",
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
        "Bytes saved for backward inside the blocks (saved-tensor hooks, parameters excluded), peak over the timed"
        " steps, per stage; units = one micro-batch's activations in that stage. Expected: GPipe m, 1F1B p - stage"
        " (at most p).",
        "",
        "| p | schedule | m | hand: MB per stage | hand: units | ds_pipeline: units | expected units |",
        "|---|---|---|---|---|---|---|",
    ]

    def units(entry: dict[str, Any]) -> str:
        return " / ".join(f"{u:.2f}" for u in entry["peak_units"].values()) if "peak_units" in entry else "failed"

    for c in s["configs"]:
        hand = c["hand"]
        mb = " / ".join(f"{b / 2**20:.2f}" for b in hand["peak_bytes"].values()) if "peak_bytes" in hand else "failed"
        expected = " / ".join(str(expected_units(c["schedule"], c["p"], c["m"], s)) for s in range(c["p"]))
        lines.append(
            f"| {c['p']} | {c['schedule']} | {c['m']} | {mb} | {units(hand)} | {units(c['ds'])} | {expected} |"
        )
    single_mem = " / ".join(
        f"m={m}: {v['peak_bytes'][0] / 2**20:.2f} MB" for m, v in single.items() if "peak_bytes" in v
    )
    lines += ["", f"Single process peak activations: {single_mem}."]
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


def write_chart(data: dict[str, Any], out: Path) -> None:
    """Step time against m, one panel per p."""
    s = data["summary"]
    import matplotlib  # here: running the benchmark needs no matplotlib until it writes

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.suptitle("ds_pipeline vs hand-written torch pipelining, 8 x (Linear(512, 512) + ReLU), batch 128")
    fig.tight_layout()
    fig.savefig(out / "pipeline.png", dpi=110)
    plt.close(fig)


def write_traces(records: list[dict[str, Any]], m: int, out: Path) -> list[Path]:
    """The last good run's spans at p=TRACE_P and m: a Chrome trace and a PNG timeline per implementation, schedule."""
    written = []
    for impl in IMPLS:
        for schedule in SCHEDULES:
            key = config_key(impl, TRACE_P, schedule, m)
            runs = [c for c in runs_of(records, key) if "error" not in c and c["spans"]]
            if not runs:
                continue
            spans = SpanRecorder.from_payload(runs[-1]["spans"])
            stem = out / f"pipeline_trace_{impl}_{schedule}"
            write_chrome_trace(spans, stem.with_suffix(".json"))
            render_timeline_png(spans, stem.with_suffix(".png"), title=f"{LABELS[impl]} {schedule}, p={TRACE_P}, m={m}")
            written += [stem.with_suffix(".json"), stem.with_suffix(".png")]
    return written


if __name__ == "__main__":
    harness.main(Pipeline())
