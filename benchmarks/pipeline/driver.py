"""ds_pipeline against a hand-written torch.distributed.pipelining loop on CPU; question, method and target: README.md.

python -m benchmarks.pipeline.driver [--quick] [--model digits|gpt] [--steps N] [--procs 2 4] [--ms 2 8] ...
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment
from benchmarks.harness import workloads as _workloads
from benchmarks.pipeline import report
from benchmarks.pipeline.report import FLOOR, IMPLS, LABELS, SCHEDULES, TARGET, config_key, runs_of
from ds_lightning.pipeline.trace import SpanRecorder, bubble_fraction

WORKER = Path(__file__).resolve().parent / "worker.py"
DIGITS_DEPTH = 8
# Per workload: a full run, then what --quick changes. m=8 is where the docs quote the targets; m=2 shows the trend.
FULL = {
    "digits": {"steps": 20, "warmup": 5, "ms": [2, 8], "batch": 128},
    "gpt": {"steps": 6, "warmup": 4, "ms": [2, 8], "batch": 8},
}
QUICK = {"digits": {"steps": 5, "warmup": 3, "ms": [2, 4]}, "gpt": {"steps": 3, "warmup": 3, "ms": [2, 4]}}


def workload_label(st: dict[str, Any]) -> str:
    if st.get("model") != "gpt":
        return f"8 x (Linear(512, 512) + ReLU), batch {st['batch']}, MSE, SGD"
    spec = _workloads.spec_of(argparse.Namespace(**st))
    return f"{_workloads.label(spec)}, batch {st['batch']} windows, cross-entropy, AdamW"


def _merge(lines: list[dict[str, Any]], procs: int) -> dict[str, dict[str, Any]]:
    """Per-rank lines merged per configuration: rank 0's step times, every rank's peak, CPU time summed; only the
    configurations every rank finished."""
    merged: dict[str, dict[str, Any]] = {}
    for line in lines:
        entry = merged.setdefault(line["key"], {"peak_bytes": {}, "unit_bytes": {}, "spans": [], "ranks": 0})
        entry["ranks"] += 1
        entry["peak_bytes"].update(line["peak_bytes"])
        entry["unit_bytes"].update(line["unit_bytes"])
        entry["spans"] += line.get("spans", [])
        entry["cpu_ms"] = entry.get("cpu_ms", 0.0) + line["cpu_ms"]
        if line["rank"] == 0:
            entry.update(median_step_ms=line["median_step_ms"], step_ms=line["step_ms"])
    return {key: e for key, e in merged.items() if "median_step_ms" in e and e["ranks"] == procs}


def run_launches(impl: str, p: int, configs: list[dict[str, Any]], opts: argparse.Namespace) -> dict[str, Any]:
    """All ``configs`` in as few launches as possible: one that fails or hangs is recorded, and a launch restarts from
    the next."""
    results: dict[str, dict[str, Any]] = {}
    remaining = list(configs)
    while remaining:
        spec = {"impl": impl, "procs": p, "configs": remaining, "seed": 0, "workload": _workloads.spec_of(opts)}
        spec.update({k: getattr(opts, k) for k in ("dist_timeout", "warmup", "steps", "trace_steps", "batch")})
        try:
            found, _, log = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1), outputs="rank*.jsonl")
            err = harness.error_line(log)
            reason = f"exit code {found['rc']}" + (f", {err}" if err else "")
        except harness.Failed as exc:  # its message: the exit code or the timeout, and the log's last error
            found, log, reason = exc.found, exc.log, str(exc)
        merged = _merge([line for k, v in found.items() if k != "rc" for line in v], p)
        results.update({c["key"]: merged[c["key"]] for c in remaining if c["key"] in merged})
        remaining = [c for c in remaining if c["key"] not in merged]
        if not remaining:
            break
        failed = remaining.pop(0)  # configurations run in order: the first one missing is where it stopped
        results[failed["key"]] = {"error": reason, "log_tail": log[-1500:]}
        print(f"  FAILED {failed['key']}: {reason}", flush=True)
    return results


def bubble(spans: list[list[Any]]) -> float | None:
    """The median over ranks of the idle share of a step, from traced spans."""
    fractions = bubble_fraction(SpanRecorder.from_payload(spans)) if spans else {}
    return statistics.median(fractions.values()) if fractions else None


def summarise_config(records: list[dict[str, Any]], key: str) -> dict[str, Any]:
    runs = runs_of(records, key)
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {
        "step_ms": harness.spread(r["median_step_ms"] for r in ok),
        "failed_runs": len(runs) - len(ok),
        "cpu_ms": harness.spread(r.get("cpu_ms") for r in ok),
    }
    if ok:  # the memory figures are counted, the same in every run: the last one's
        for k in ("peak_bytes", "unit_bytes"):
            out[k] = {int(s): b for s, b in sorted(ok[-1][k].items(), key=lambda kv: int(kv[0]))}
        out["peak_units"] = {s: out["peak_bytes"][s] / out["unit_bytes"][s] for s in out["peak_bytes"]}
        out["bubble"] = harness.spread(r["bubble"] if "bubble" in r else bubble(r["spans"]) for r in ok)
    if len(ok) < len(runs):
        out["errors"] = [r["error"] for r in runs if "error" in r]
    return out


def pipe_configs(p: int, ms: list[int]) -> list[dict[str, Any]]:
    """Every (schedule, m) for p stages; 1F1B needs n_microbatches >= stages."""
    return [{"schedule": s, "m": m} for s in SCHEDULES for m in ms if not (s == "1F1B" and m < p)]


def trace_m(ms: list[int]) -> int:
    return report.TRACE_M if report.TRACE_M in ms else max(ms)


def step_by_repeat(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    """One configuration's median step time by repeat, where it ran."""
    return {
        r["repeat"]: c["median_step_ms"]
        for r in records
        if "median_step_ms" in (c := r.get("configs", {}).get(key, {}))
    }


class Pipeline(harness.Benchmark):
    name = "pipeline"
    description = __doc__
    models = ("digits", "gpt")
    # 5 repeats: identical launches differ by 10% and more at p=4; FULL holds the rest, per workload
    defaults = {"repeats": 5, "procs": [2, 4], "trace_steps": 3}
    quick = {"repeats": 1, "procs": [2], "trace_steps": 2}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (20, GPT 6)")
        parser.add_argument("--warmup", type=int, default=None, help="discarded steps first (5, GPT 4)")
        parser.add_argument("--procs", type=int, nargs="+", default=None, help="processes = stages (2 4)")
        parser.add_argument("--ms", type=int, nargs="+", default=None, help="micro-batch counts (2 8)")
        parser.add_argument("--batch", type=int, default=None, help="rows per step (128; GPT 8 windows)")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take (600)")
        parser.add_argument("--dist-timeout", type=int, default=120, help="seconds a collective may wait (120)")
        parser.add_argument("--trace-steps", type=int, default=None, help=argparse.SUPPRESS)
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        _workloads.fill_defaults(opts, FULL, QUICK)
        opts.procs, opts.ms = sorted(opts.procs), sorted(opts.ms)
        blocks = opts.gpt_layers if opts.model == "gpt" else DIGITS_DEPTH
        bad = [p for p in opts.procs if p < 2 or blocks % p] + [m for m in opts.ms if m < 1 or opts.batch % m]
        if bad:
            raise SystemExit(
                f"{bad}: p must be at least 2 and divide the model's {blocks} blocks, and m divide the batch of"
                f" {opts.batch} rows; e.g. --procs 2 --ms 1 2 4"
            )
        # Traced steps are steps 1..trace_steps (after one skipped), kept inside the discarded warm-up.
        opts.warmup = max(opts.warmup, opts.trace_steps + 1)
        return {"cpus": os.cpu_count(), "workload": workload_label(vars(opts))}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [Arm("single", {"impl": "single", "p": 1}, LABELS["single"])]
        impls = ("hand", FLOOR, "ds")
        arms += [Arm(f"{i} p={p}", {"impl": i, "p": p}, f"{LABELS[i]}, p={p}") for p in opts.procs for i in impls]
        return Experiment(arms, opts.repeats)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        impl, p = arm.params["impl"], arm.params["p"]
        single = [{"schedule": "seq", "m": m} for m in sorted({1, *opts.ms})]
        configs = single if impl == "single" else pipe_configs(p, opts.ms)
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
        single = {m: summarise_config(records, config_key("single", 1, "seq", m)) for m in sorted({1, *ms})}
        configs = []
        for p in procs:
            for s, m in ((c["schedule"], c["m"]) for c in pipe_configs(p, ms)):
                entry: dict[str, Any] = {"p": p, "schedule": s, "m": m, "bubble_formula": (p - 1) / (m + p - 1)}
                entry.update({i: summarise_config(records, config_key(i, p, s, m)) for i in (*IMPLS, FLOOR)})
                hand, floor, ds = (step_by_repeat(records, config_key(i, p, s, m)) for i in ("hand", FLOOR, "ds"))
                entry["ratio_ds_over_hand"] = harness.spread(ds[k] / hand[k] for k in sorted(set(hand) & set(ds)))
                # Where it ran: results from before the Lightning arm existed have none.
                both = sorted(set(floor) & set(ds))
                entry["ratio_ds_over_lightning"] = harness.spread(ds[k] / floor[k] for k in both)
                configs.append(entry)
        gpt = st.get("model") == "gpt"
        meta = {"procs": procs, "ms": ms, "trace_m": trace_m(ms), "workload": workload_label(st)}
        meta.update(unit="tokens" if gpt else "samples", per_step=st["batch"] * (st["gpt_block"] if gpt else 1))
        what = "ds_pipeline / hand-written step time, p={p} {schedule} m={m}"
        in_pl = "ds_pipeline / hand-written in Lightning step time, p={p} {schedule} m={m}"
        verdicts = [
            harness.judged(label.format(**c), c[key], at_most=TARGET, unit="x")
            for c in configs
            for label, key in ((what, "ratio_ds_over_hand"), (in_pl, "ratio_ds_over_lightning"))
        ]
        return {"meta": meta, "single": single, "configs": configs, "verdicts": verdicts}

    def compact(self, data: dict[str, Any]) -> dict[str, Any]:
        """Step times as quantiles, spans as a bubble; only the runs the traces are drawn from keep their spans."""
        m = trace_m(data["settings"]["ms"])
        keep = {id(report.traced_run(data["records"], i, s, m)) for i in IMPLS for s in SCHEDULES}
        for run in (run for record in data["records"] for run in record.get("configs", {}).values()):
            if isinstance(run.get("step_ms"), list):
                run["step_ms"] = harness.series(run["step_ms"])
            if "spans" in run and "error" not in run:
                run.setdefault("bubble", bubble(run["spans"]))
                if id(run) not in keep:
                    del run["spans"]
        return data

    def report(self, data: dict[str, Any]) -> list[str]:
        return report.markdown(data)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        stem = harness.stem(self, data["settings"].get("model"))
        return [
            report.step_chart(data, out / f"{stem}.png"),
            *report.write_traces(data["records"], data["summary"]["meta"]["trace_m"], out, stem),
        ]


if __name__ == "__main__":
    harness.main(Pipeline())
