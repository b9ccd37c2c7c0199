"""How close is ds_pipeline to a hand-written torch.distributed.pipelining loop, and what do micro-batching and the
schedule do on CPU?

Model: 8 blocks of Linear(512, 512) + ReLU, batch 128 of fixed random data, MSE loss, SGD. For GPipe and 1F1B, m
micro-batches (1, 2, 4, 8, 16; 1F1B needs m >= p) and p processes = stages (2, 4), it measures the median step time of
(a) ds_pipeline under a Lightning Trainer and (b) a hand-written loop with the same torch schedule, against one process
doing forward + backward + step (also over m sequential chunks, which isolates the cost of micro-batching). Every
configuration of one (implementation, p) runs inside one launch of p processes (gloo, 1 thread each); the launches are
interleaved round by round. It also measures the bubble from traced spans (next to the formula (p-1)/(m+p-1)) and the
peak activation memory per stage, counted with saved-tensor hooks (in units of one micro-batch's activations).

Writes ``pipeline.json``, ``pipeline.md``, ``pipeline.png`` and, for p=2 and m=8, a Chrome trace and a PNG timeline per
schedule and implementation (``pipeline_trace_<impl>_<schedule>.json/.png``) to ``results/`` (or ``--out``; ``--quick``
writes to a temporary folder unless ``--out`` is given).

    python benchmarks/pipeline.py [--quick] [--rounds 3] [--steps 40] [--warmup 5] [--procs 2 4] [--ms 1 2 4 8 16]
                                  [--timeout 600] [--dist-timeout 120] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_detached, spread, worker_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
WORKER = HERE / "_pipeline_worker.py"

sys.path.insert(0, str(REPO))

from ds_lightning.pipeline.trace import SpanRecorder, bubble_fraction, render_timeline_png, write_chrome_trace  # noqa: E402

SCHEDULES = ("GPipe", "1F1B")
IMPLS = ("hand", "ds")
LABELS = {"single": "single process", "hand": "hand-written loop", "ds": "ds_pipeline"}
TRACE_P, TRACE_M = 2, 8
TARGET = 1.05


# --- launching --------------------------------------------------------------------------------------------------------


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


def launch_once(impl: str, p: int, configs: list[dict[str, Any]], opts: argparse.Namespace) -> tuple[Any, str, dict]:
    """One launch of the worker over ``configs``; returns (exit code or "timeout", log tail, merged records)."""
    with tempfile.TemporaryDirectory(prefix="ds-pipeline-bench-") as tmp:
        records = Path(tmp) / "records"
        records.mkdir()
        spec = {
            "impl": impl,
            "procs": p,
            "configs": configs,
            "warmup": opts.warmup,
            "steps": opts.steps,
            "trace_steps": opts.trace_steps,
            "seed": 0,
            "dist_timeout": opts.dist_timeout,
            "records": str(records),
        }
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = Path(tmp) / "log.txt"
        rc: Any = run_detached(WORKER, spec_path, tmp, log_path, opts.timeout, worker_env())
        tail = log_path.read_text(errors="replace")[-3000:]
        lines = []
        for path in sorted(records.glob("rank*.jsonl")):
            for text in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
                    lines.append(json.loads(text))
        return rc, tail, _merge(lines, p)


def launch(impl: str, p: int, configs: list[dict[str, Any]], opts: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Run all ``configs`` in as few launches as possible; a configuration that fails or hangs is recorded as failed
    and the launch is restarted from the next one."""
    results: dict[str, dict[str, Any]] = {}
    remaining = list(configs)
    while remaining:
        rc, tail, merged = launch_once(impl, p, remaining, opts)
        results.update({c["key"]: merged[c["key"]] for c in remaining if c["key"] in merged})
        remaining = [c for c in remaining if c["key"] not in merged]
        if not remaining:
            break
        failed = remaining.pop(0)  # configurations run in order: the first one missing is where it stopped
        reason = f"timed out after {opts.timeout:.0f} s" if rc == "timeout" else f"exit code {rc}"
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in tail.splitlines()]
        errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Timeout)\b", line)]
        if errors:
            reason += f", {errors[-1][:300]}"
        results[failed["key"]] = {"error": reason, "log_tail": tail[-1500:]}
        print(f"  FAILED {failed['key']}: {reason}; log tail:\n{tail[-1500:]}", flush=True)
    return results


# --- statistics -------------------------------------------------------------------------------------------------------


def bubble(spans: list[list[Any]]) -> float | None:
    if not spans:
        return None
    fractions = bubble_fraction(SpanRecorder.from_payload(spans))
    return statistics.median(fractions.values()) if fractions else None


def formula(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def summarise(
    rounds: list[dict[str, dict[str, Any]]], p: int | None, schedule: str, m: int, impl: str
) -> dict[str, Any]:
    key = config_key(impl, p or 1, schedule, m)
    runs = [r[key] for r in rounds if key in r]
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"step_ms": spread([r["median_step_ms"] for r in ok]), "failed_rounds": len(runs) - len(ok)}
    if ok:
        last = ok[-1]
        out["peak_bytes"] = {int(s): b for s, b in sorted(last["peak_bytes"].items(), key=lambda kv: int(kv[0]))}
        out["unit_bytes"] = {int(s): b for s, b in sorted(last["unit_bytes"].items(), key=lambda kv: int(kv[0]))}
        out["peak_units"] = {s: out["peak_bytes"][s] / out["unit_bytes"][s] for s in out["peak_bytes"]}
        bubbles = [b for b in (bubble(r["spans"]) for r in ok) if b is not None]
        out["bubble"] = spread(bubbles)
    if len(ok) < len(runs):
        out["errors"] = [r["error"] for r in runs if "error" in r]
    return out


def expected_units(schedule: str, p: int, m: int, stage: int) -> int:
    return m if schedule == "GPipe" else min(m, p - stage)


# --- outputs ----------------------------------------------------------------------------------------------------------


def _cell(v: dict[str, Any] | None, fmt: str = ".1f") -> str:
    if v is None:
        return "failed"
    return f"{v['median']:{fmt}} [{v['min']:{fmt}} - {v['max']:{fmt}}]"


def write_markdown(data: dict[str, Any], out: Path) -> str:
    meta = data["meta"]
    single = data["single"]
    base = single[1]["step_ms"]
    lines = [
        f"8 x (Linear(512, 512) + ReLU), batch 128, MSE, SGD; p CPU processes (gloo, 1 thread each) on a machine with"
        f" {meta['cpus']} cores; {meta['steps']} timed steps per configuration after {meta['warmup']} warm-up steps,"
        f" {meta['rounds']} interleaved round(s). Median over rounds of per-run medians [min - max]. Total run"
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
    for c in data["configs"]:
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
    for c in data["configs"]:
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

    for c in data["configs"]:
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
        f"- p={c['p']} {c['schedule']} m={c['m']} {LABELS[impl]}: {c[impl]['failed_rounds']} failed round(s):"
        f" {'; '.join(dict.fromkeys(c[impl]['errors']))}"
        for c in data["configs"]
        for impl in IMPLS
        if c[impl]["failed_rounds"]
    ]
    failures += [
        f"- single process m={m}: {v['failed_rounds']} failed round(s): {'; '.join(dict.fromkeys(v['errors']))}"
        for m, v in single.items()
        if v["failed_rounds"]
    ]
    if failures:
        lines += ["", "## Failures", "", *failures]
    text = "\n".join(lines) + "\n"
    (out / "pipeline.md").write_text(text)
    return text


def write_chart(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = data["meta"]["procs"]
    fig, axes = plt.subplots(1, len(procs), figsize=(max(8.0, 6.5 * len(procs)), 4.8), squeeze=False)
    styles = {
        ("hand", "GPipe"): ("tab:blue", "o", "-"),
        ("ds", "GPipe"): ("tab:blue", "s", "--"),
        ("hand", "1F1B"): ("tab:orange", "o", "-"),
        ("ds", "1F1B"): ("tab:orange", "s", "--"),
    }
    single = data["single"]
    for ax, p in zip(axes[0], procs, strict=True):
        for (impl, schedule), (colour, marker, line) in styles.items():
            points = [
                (c["m"], c[impl]["step_ms"])
                for c in data["configs"]
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
        ax.set_xticks(data["meta"]["ms"], [str(m) for m in data["meta"]["ms"]])
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("median step time (ms)")
        ax.set_title(f"p = {p} stages (CPU processes), min-max over rounds")
        ax.legend(fontsize=8)
    fig.suptitle("ds_pipeline vs hand-written torch pipelining, 8 x (Linear(512, 512) + ReLU), batch 128")
    fig.tight_layout()
    fig.savefig(out / "pipeline.png", dpi=110)
    plt.close(fig)


def write_traces(rounds: list[dict[str, dict[str, Any]]], m: int, out: Path) -> list[str]:
    written = []
    for impl in IMPLS:
        for schedule in SCHEDULES:
            key = config_key(impl, TRACE_P, schedule, m)
            runs = [r[key] for r in rounds if key in r and "error" not in r[key] and r[key]["spans"]]
            if not runs:
                continue
            spans = SpanRecorder.from_payload(runs[-1]["spans"])
            stem = out / f"pipeline_trace_{impl}_{schedule}"
            write_chrome_trace(spans, stem.with_suffix(".json"))
            render_timeline_png(spans, stem.with_suffix(".png"), title=f"{LABELS[impl]} {schedule}, p={TRACE_P}, m={m}")
            written.append(stem.name)
    return written


# --- main -------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="p=2, m in 2 and 4, 1 round, 5 steps: a smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 40)")
    parser.add_argument("--warmup", type=int, default=None, help="discarded steps first (default 5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take before it is killed")
    parser.add_argument(
        "--dist-timeout", type=int, default=120, help="seconds a collective may wait (turns hangs into errors)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/results; a temp folder with --quick)"
    )
    parser.add_argument("--procs", type=int, nargs="+", default=None, help="processes = stages (default 2 4)")
    parser.add_argument("--ms", type=int, nargs="+", default=None, help="micro-batch counts (default 1 2 4 8 16)")
    opts = parser.parse_args()
    if opts.quick:
        procs, ms = [2], [2, 4]
        defaults = {"rounds": 1, "steps": 5, "warmup": 3}
        opts.trace_steps = 2
    else:
        procs, ms = [2, 4], [1, 2, 4, 8, 16]
        defaults = {"rounds": 3, "steps": 40, "warmup": 5}
        opts.trace_steps = 3
    procs, ms = sorted(opts.procs or procs), sorted(opts.ms or ms)
    bad = [p for p in procs if p < 2 or 8 % p] + [m for m in ms if m < 1 or 128 % m]
    if bad:
        parser.error(f"{bad}: p must divide the 8 blocks (2, 4, 8) and m the batch of 128")
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    # Traced steps are steps 1..trace_steps (after one skipped), kept inside the discarded warm-up.
    opts.warmup = max(opts.warmup, opts.trace_steps + 1)
    trace_m = TRACE_M if TRACE_M in ms else max(ms)
    if opts.out is None:  # a smoke test never overwrites the real results
        opts.out = Path(tempfile.mkdtemp(prefix="ds-pipeline-quick-")) if opts.quick else RESULTS
    opts.out.mkdir(parents=True, exist_ok=True)

    single_configs = [{"key": config_key("single", 1, "seq", m), "schedule": "seq", "m": m} for m in sorted({1, *ms})]
    pipe_configs = {
        p: [
            {"key": "", "schedule": s, "m": m}
            for s in SCHEDULES
            for m in ms
            if not (s == "1F1B" and m < p)  # 1F1B needs n_microbatches >= stages
        ]
        for p in procs
    }
    started = time.perf_counter()
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(opts.rounds):
        results: dict[str, dict[str, Any]] = {}
        t0 = time.perf_counter()
        results.update(launch("single", 1, single_configs, opts))
        print(f"round {r + 1}/{opts.rounds} single: {time.perf_counter() - t0:.0f} s", flush=True)
        for p in procs:
            order = IMPLS if r % 2 == 0 else IMPLS[::-1]  # alternate which implementation goes first
            for impl in order:
                t0 = time.perf_counter()
                configs = [{**c, "key": config_key(impl, p, c["schedule"], c["m"])} for c in pipe_configs[p]]
                results.update(launch(impl, p, configs, opts))
                times = ", ".join(
                    f"{c['schedule']} m={c['m']}: "
                    + (f"{results[c['key']]['median_step_ms']:.1f}" if "error" not in results[c["key"]] else "FAILED")
                    for c in configs
                )
                print(
                    f"round {r + 1}/{opts.rounds} {impl} p={p} ({time.perf_counter() - t0:.0f} s): {times}", flush=True
                )
        rounds.append(results)

    data: dict[str, Any] = {
        "meta": {
            "rounds": opts.rounds,
            "steps": opts.steps,
            "warmup": opts.warmup,
            "trace_steps": opts.trace_steps,
            "trace_m": trace_m,
            "procs": procs,
            "ms": ms,
            "quick": opts.quick,
            "cpus": os.cpu_count(),
            "seconds": time.perf_counter() - started,
            "model": "8 x (Linear(512, 512) + ReLU), batch 128, MSE, SGD(lr=0.01)",
        },
        "single": {c["m"]: summarise(rounds, None, "seq", c["m"], "single") for c in single_configs},
        "configs": [],
    }
    for p in procs:
        for c in pipe_configs[p]:
            s, m = c["schedule"], c["m"]
            entry = {"p": p, "schedule": s, "m": m, "bubble_formula": formula(p, m)}
            for impl in IMPLS:
                entry[impl] = summarise(rounds, p, s, m, impl)
            ratios = []
            for rnd in rounds:
                hand, ds = rnd.get(config_key("hand", p, s, m), {}), rnd.get(config_key("ds", p, s, m), {})
                if "median_step_ms" in hand and "median_step_ms" in ds:
                    ratios.append(ds["median_step_ms"] / hand["median_step_ms"])
            entry["ratio_ds_over_hand"] = spread(ratios)
            data["configs"].append(entry)
    data["traces"] = write_traces(rounds, trace_m, opts.out)
    (opts.out / "pipeline.json").write_text(json.dumps(data, indent=2))
    print(write_markdown(data, opts.out))
    write_chart(data, opts.out)
    print(
        f"wrote pipeline.json, pipeline.md, pipeline.png and traces {data['traces']} to {opts.out}"
        f" ({data['meta']['seconds']:.0f} s)"
    )


if __name__ == "__main__":
    main()
