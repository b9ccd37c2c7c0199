"""How close is ds_pipeline to a hand-written torch.distributed.pipelining loop, and what do micro-batching and the
schedule do on CPU?

Model: 8 blocks of Linear(512, 512) + ReLU, batch 128 of fixed random data, MSE loss, SGD. For GPipe and 1F1B, m
micro-batches (1, 2, 4, 8; 1F1B needs m >= p) and p processes = stages (2, 4), it measures the median step time of
(a) ds_pipeline under a Lightning Trainer and (b) a hand-written loop with the same torch schedule, against one process
doing forward + backward + step (also over m sequential chunks, which isolates the cost of micro-batching). Every
configuration of one (implementation, p) runs inside one launch of p processes (gloo, 1 thread each), an arm of the
benchmark harness, which interleaves the launches repeat by repeat. It also measures the bubble from traced spans (next
to the formula (p-1)/(m+p-1)) and the peak activation memory per stage, counted with saved-tensor hooks (in units of one
micro-batch's activations).

``--model gpt`` runs the same comparison on the byte-level GPT of ``harness/workloads.py`` (batch 8 windows of
128 tokens, cross-entropy, AdamW; the embedding on the first stage, equal runs of blocks, the final norm and head on the
last), with throughput in tokens/s; its results go to ``pipeline_gpt.*``.

Besides ``pipeline.json/.md/.png`` it writes a chart of peak activation memory per stage (``pipeline_memory.png``) and,
for p=2 and m=8, a Chrome trace and a PNG timeline per schedule and implementation
(``pipeline_trace_<impl>_<schedule>.json/.png``); under ``--model gpt`` every name starts ``pipeline_gpt``.

    python -m benchmarks.pipeline.driver [--quick] [--model digits|gpt] [--repeats 3] [--out DIR] [--render [JSON]]
        [--steps 40] [--warmup 5] [--procs 2 4] [--ms 1 2 4 8] [--batch 128] [--timeout 600] [--dist-timeout 120]
        [--gpt-layers 4] [--gpt-heads 4] [--gpt-width 128] [--gpt-block 128]

``--model digits`` (the default) keeps this benchmark's own 8 x Linear(512, 512) model on random data rather than the
digits MLP, so its results stay comparable with earlier runs.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment
from benchmarks.harness import workloads as _workloads
from benchmarks.pipeline.report import (
    IMPLS,
    LABELS,
    SCHEDULES,
    TARGET,
    TRACE_M,
    TRACE_P,
    config_key,
    markdown,
    runs_of,
    write_chart,
    write_memory_chart,
    write_traces,
)
from ds_lightning.pipeline.trace import SpanRecorder, bubble_fraction

WORKER = Path(__file__).resolve().parent / "worker.py"
DIGITS_DEPTH = 8
# Per-model values of the options left unset: a full run, then what --quick changes.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"steps": 40, "warmup": 5, "ms": [1, 2, 4, 8], "batch": 128},
    "gpt": {"steps": 10, "warmup": 4, "ms": [1, 2, 4, 8], "batch": 8},
}
MODEL_QUICK: dict[str, dict[str, Any]] = {
    "digits": {"steps": 5, "warmup": 3, "ms": [2, 4]},
    "gpt": {"steps": 3, "warmup": 3, "ms": [2, 4]},
}


def model_defaults(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill the options still ``None`` with the workload's defaults (``--quick``'s where it has one)."""
    return _workloads.fill_defaults(opts, MODEL_DEFAULTS, MODEL_QUICK)


def check_split(opts: argparse.Namespace) -> None:
    """Refuse a p that does not split the model's blocks equally, or an m that does not split the batch."""
    blocks = opts.gpt_layers if opts.model == "gpt" else DIGITS_DEPTH
    bad = [p for p in opts.procs if p < 2 or blocks % p] + [m for m in opts.ms if m < 1 or opts.batch % m]
    if bad:
        raise SystemExit(
            f"{bad}: p must be at least 2 and divide the model's {blocks} blocks, and m divide the batch of"
            f" {opts.batch} rows; e.g. --procs 2 --ms 1 2 4"
        )


def workload_label(settings: dict[str, Any]) -> str:
    """The results page's name for what was trained."""
    if settings.get("model") != "gpt":
        return f"8 x (Linear(512, 512) + ReLU), batch {settings.get('batch', 128)}, MSE, SGD"
    workload = {
        "model": "gpt",
        "n_layer": settings["gpt_layers"],
        "n_head": settings["gpt_heads"],
        "d_model": settings["gpt_width"],
        "block_size": settings["gpt_block"],
    }
    return f"{_workloads.label(workload)}, batch {settings['batch']} windows, cross-entropy, AdamW"


def throughput_basis(settings: dict[str, Any]) -> tuple[int, str]:
    """Units one step processes (rows, or rows x context for the GPT) and their name."""
    if settings.get("model") == "gpt":
        return settings["batch"] * settings["gpt_block"], "tokens"
    return settings.get("batch", 128), "samples"


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
        if line.get("cpu_ms") is not None:
            entry["cpu_ms"] = entry.get("cpu_ms", 0.0) + line["cpu_ms"]  # every rank's, summed
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
        spec.update(warmup=opts.warmup, steps=opts.steps, trace_steps=opts.trace_steps, batch=opts.batch)
        spec["workload"] = _workloads.spec_of(opts)
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
        "cpu_ms": harness.spread(r.get("cpu_ms") for r in ok),  # every rank's CPU per step, summed
    }
    if ok:
        last = ok[-1]
        out["peak_bytes"] = {int(s): b for s, b in sorted(last["peak_bytes"].items(), key=lambda kv: int(kv[0]))}
        out["unit_bytes"] = {int(s): b for s, b in sorted(last["unit_bytes"].items(), key=lambda kv: int(kv[0]))}
        out["peak_units"] = {s: out["peak_bytes"][s] / out["unit_bytes"][s] for s in out["peak_bytes"]}
        out["bubble"] = harness.spread(r["bubble"] if "bubble" in r else bubble(r["spans"]) for r in ok)
    if len(ok) < len(runs):
        out["errors"] = [r["error"] for r in runs if "error" in r]
    return out


def bubble(spans: list[list[Any]]) -> float | None:
    """The median over ranks of the idle share of a step, from traced spans."""
    if not spans:
        return None
    fractions = bubble_fraction(SpanRecorder.from_payload(spans))
    return statistics.median(fractions.values()) if fractions else None


def compact_data(data: dict[str, Any]) -> dict[str, Any]:
    """Every run's step times as quantiles and its spans as its bubble; only the runs the traces are drawn from (the
    last good one at p=TRACE_P, m=trace_m) keep their spans, so ``--render`` redraws them."""
    ms = sorted(data["settings"]["ms"])
    trace_m = TRACE_M if TRACE_M in ms else max(ms)
    traced = {config_key(impl, TRACE_P, s, trace_m) for impl in IMPLS for s in SCHEDULES}
    keep = {
        id((runs or [None])[-1])
        for key in traced
        for runs in [[c for c in runs_of(data["records"], key) if "error" not in c and c.get("spans")]]
    }
    for record in data["records"]:
        for run in record.get("configs", {}).values():
            if isinstance(run.get("step_ms"), list):
                run["step_ms"] = harness.series(run["step_ms"])
            if "spans" in run and "error" not in run:
                run.setdefault("bubble", bubble(run["spans"]))
                if id(run) not in keep:
                    del run["spans"]
    return data


def formula(p: int, m: int) -> float:
    """The bubble's textbook share."""
    return (p - 1) / (m + p - 1)


def pipe_configs(p: int, ms: list[int]) -> list[dict[str, Any]]:
    """Every (schedule, m) for p stages; 1F1B needs n_microbatches >= stages."""
    return [{"schedule": s, "m": m} for s in SCHEDULES for m in ms if not (s == "1F1B" and m < p)]


class Pipeline(harness.Benchmark):
    name = "pipeline"
    description = __doc__
    models = ("digits", "gpt")
    # steps, warmup, ms and batch depend on the workload: see MODEL_DEFAULTS
    defaults = {"repeats": 3, "procs": [2, 4], "trace_steps": 3}
    quick = {"repeats": 1, "procs": [2], "trace_steps": 2}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--steps", type=int, default=None, help="timed steps per configuration (40, GPT 10; --quick 5, GPT 3)"
        )
        parser.add_argument("--warmup", type=int, default=None, help="discarded steps first (5, GPT 4; --quick 3)")
        parser.add_argument("--procs", type=int, nargs="+", default=None, help="processes = stages (2 4)")
        parser.add_argument("--ms", type=int, nargs="+", default=None, help="micro-batch counts (1 2 4 8; --quick 2 4)")
        parser.add_argument("--batch", type=int, default=None, help="rows per step (128; GPT 8 windows)")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take (600)")
        parser.add_argument("--dist-timeout", type=int, default=120, help="seconds a collective may wait (120)")
        parser.add_argument("--trace-steps", type=int, default=None, help=argparse.SUPPRESS)
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        model_defaults(opts)
        opts.procs, opts.ms = sorted(opts.procs), sorted(opts.ms)
        check_split(opts)
        # Traced steps are steps 1..trace_steps (after one skipped), kept inside the discarded warm-up.
        opts.warmup = max(opts.warmup, opts.trace_steps + 1)
        return {"cpus": os.cpu_count(), "workload": workload_label(vars(opts))}

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
        per_step, unit = throughput_basis(st)
        meta = {"procs": procs, "ms": ms, "trace_m": trace_m, "workload": workload_label(st)}
        meta.update(per_step=per_step, unit=unit)
        verdicts = [
            harness.judged(
                f"ds_pipeline / hand-written step time, p={c['p']} {c['schedule']} m={c['m']}",
                c["ratio_ds_over_hand"],
                at_most=TARGET,
                unit="x",
            )
            for c in configs
        ]
        return {"meta": meta, "single": single, "configs": configs, "verdicts": verdicts}

    def compact(self, data: dict[str, Any]) -> dict[str, Any]:
        return compact_data(data)

    def report(self, data: dict[str, Any]) -> list[str]:
        return markdown(data)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        stem = harness.stem(self, data["settings"].get("model"))
        trace_m = data["summary"]["meta"]["trace_m"]
        return [
            write_chart(data, out / f"{stem}.png"),
            write_memory_chart(data, out / f"{stem}_memory.png"),
            *write_traces(data["records"], trace_m, out, stem),
        ]


if __name__ == "__main__":
    harness.main(Pipeline())
