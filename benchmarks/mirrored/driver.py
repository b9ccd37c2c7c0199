"""ds_mirrored against Lightning's ddp and a plain torch DDP loop, per gradient_compression setting, and auto.
The arms, the workloads, the targets and the options: README.md in this folder.

    python -m benchmarks.mirrored.driver [--quick] [--model digits|gpt] [--repeats 3] [--out DIR] [--render [JSON]]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, Panel, fmt
from benchmarks.harness import workloads as _workloads
from benchmarks.mirrored.auto import AUTO, LOOPBACK_TARGET, loopback_lines, loopback_summary

WORKER = Path(__file__).resolve().parent / "worker.py"
STRATEGIES = {
    "ds_mirrored": {"mode": "lightning", "strategy": "ds_mirrored", "compression": "none"},
    "lightning_ddp": {"mode": "lightning", "strategy": "ddp", "compression": "none"},
    "plain_ddp": {"mode": "plain"},
}
#: the compression arms run; bf16 sends what fp16 sends, so only results written before it was dropped show it
COMPRESSIONS = ("fp16", "powersgd")
LINKS_MBIT = {"1 Gbit/s": 1000.0, "100 Mbit/s": 100.0}
TARGETS = {"lightning_ddp": ("Lightning ddp", 1.00), "plain_ddp": ("plain DDP loop", 1.10)}  # ds_mirrored / each
#: steps, warm-up and batch per process left unset: a full run, then --quick
FULL = {"digits": {"steps": 80, "warmup": 10, "batch_size": 32}, "gpt": {"steps": 10, "warmup": 3, "batch_size": 8}}
QUICK = {"digits": {"steps": 10, "warmup": 2}, "gpt": {"steps": 4, "warmup": 2}}
RECORDED = ("mean_step_ms", "comm_bytes_per_step", "uncompressed_bytes_per_step", "auto")


def compression_arms(arms: dict[str, Any]) -> dict[str, str]:
    """Setting by arm, for every arm of ``ds_mirrored`` at a fixed ``gradient_compression`` (``none`` included)."""
    return {a: "none" if a == "ds_mirrored" else a for a in arms if a not in ("lightning_ddp", "plain_ddp", AUTO)}


def unit_of(data: dict[str, Any]) -> str:
    return "tokens" if data["workload"]["model"] == "gpt" else "samples"


def block_of(data: dict[str, Any]) -> int:
    return int(data["workload"].get("block_size", 1))


def compression_summary(v: dict[str, Any], setting: str, records: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    sent = v["comm_bytes_per_step"]["median"] if v["comm_bytes_per_step"] else None
    step = v["step_ms"]["median"] if v["step_ms"] else None
    full = next((r.get("uncompressed_bytes_per_step") for r in harness.ok(records, arm)), None)
    # A projection, not a measurement: loopback time plus the payload at the link rate (a 2-rank ring all-reduce
    # sends about the payload once per rank); cluster/ measures shaped links.
    projected = {
        link: step + sent * 8 / (mbit * 1e6) * 1000 if step and sent else None for link, mbit in LINKS_MBIT.items()
    }
    return dict(setting=setting, bytes_per_step=sent, uncompressed_bytes_per_step=full, projected_step_ms=projected)


class Mirrored(harness.Benchmark):
    name = "mirrored"
    description = __doc__
    models = ("digits", "gpt")

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, help="timed steps per run (digits 80, GPT 10; --quick: 10, 4)")
        parser.add_argument("--warmup", type=int, help="warm-up steps left out (digits 10, GPT 3; --quick: 2)")
        parser.add_argument("--batch-size", type=int, help="batch per process (digits 32, GPT 8)")
        parser.add_argument("--auto-interval", type=int, help="the auto arm's auto_interval (the strategy's 500)")
        view = "gradient_as_bucket_view of the ddp and plain DDP baselines: true is ds_mirrored's (like for like)"
        parser.add_argument("--baseline-bucket-view", choices=["true", "false"], default="true", help=view)
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (600)")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        _workloads.fill_defaults(opts, FULL, QUICK)
        workload = _workloads.spec_of(opts)
        return {"workload": workload, "workload_label": _workloads.label(workload)}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [Arm(n, p) for n, p in STRATEGIES.items()]
        for c in (*COMPRESSIONS, AUTO):
            arms.append(Arm(c, {"mode": "lightning", "strategy": "ds_mirrored", "compression": c}, f"ds_mirrored {c}"))
        return Experiment(arms, opts.repeats, baseline="ds_mirrored")

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {**arm.params, "batch_size": opts.batch_size, "auto_interval": opts.auto_interval}
        spec["bucket_view"] = opts.baseline_bucket_view == "true"  # the baselines'; ds_mirrored's is its own (True)
        spec.update(steps=opts.steps, warmup=opts.warmup, workload=_workloads.spec_of(opts))
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1))
        r = found["result"]
        return {"rc": found["rc"], "step_ms": r["median_step_ms"], **{k: r[k] for k in RECORDED if k in r}}

    def progress(self, record: dict[str, Any]) -> str:
        return f"{record['step_ms']:.2f} ms/step"

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        st = data["settings"]
        # throughput is derived here, not recorded: the global batch (2 processes) at a run's median step time
        per_step = 2 * st["batch_size"] * block_of(data)
        records = [
            {**r, "throughput": per_step * 1000 / r["step_ms"]} if r.get("step_ms") else r for r in data["records"]
        ]
        keys = ["step_ms", "throughput", "comm_bytes_per_step", "mean_step_ms"]
        s = harness.summarise(records, list(data["arms"]), keys)
        for arm in TARGETS:
            s["ds_mirrored"][f"over_{arm}"] = harness.paired(records, "ds_mirrored", arm, "step_ms")
        for arm, setting in compression_arms(data["arms"]).items():
            s[arm]["compression"] = compression_summary(s[arm], setting, records, arm)
        s[AUTO]["auto"] = auto = loopback_summary(records, "ds_mirrored", st["warmup"], st["steps"])
        s["verdicts"] = [
            harness.judged(f"ds_mirrored / {name} step time", s["ds_mirrored"][f"over_{arm}"], at_most=bound, unit="x")
            for arm, (name, bound) in TARGETS.items()
        ]
        what = "auto / none step time on loopback"
        s["verdicts"].append(harness.judged(what, auto["over_none"], at_most=LOOPBACK_TARGET, unit="x"))
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, st, unit = data["summary"], data["settings"], unit_of(data)
        rows = [[n, fmt(s[n]["step_ms"], ".2f"), fmt(s[n].get("throughput"), ".0f")] for n in STRATEGIES]
        for arm, (name, bound) in TARGETS.items():
            over = fmt(s["ds_mirrored"][f"over_{arm}"], ".3f")
            rows.append([f"**ds_mirrored / {name} (target <= {bound:.2f})**", f"**{over}**", ""])
        comp_rows = []
        for arm in compression_arms(data["arms"]):
            c = s[arm]["compression"]
            sent, full, p = c["bytes_per_step"], c["uncompressed_bytes_per_step"], c["projected_step_ms"]
            comp_rows.append(
                [
                    c["setting"],
                    f"{sent / 1e6:.3f} MB" if sent else "-",
                    f"{sent / full:.3f}x" if sent and full else "-",
                    fmt(s[arm]["step_ms"], ".2f"),
                    fmt(s[arm].get("throughput"), ".0f"),
                    *(f"{p[link]:.1f}" if p[link] else "-" for link in LINKS_MBIT),
                ]
            )
        failed = [f"{a}: {e}" for a in data["arms"] for e in s[a]["errors"]]
        tokens = f" x {block_of(data)} tokens" if unit == "tokens" else ""
        view = st["baseline_bucket_view"] == "true"
        comp_head = ["gradient_compression", "payload/step (counted)", "vs none", "loopback step (ms)"]
        comp_head += [f"loopback {unit}/s", "projected @1 Gbit/s", "projected @100 Mbit/s"]
        return [
            f"# ds_mirrored on the {data['workload_label']}",
            "",
            f"2 CPU processes (gloo, 1 thread each), batch {st['batch_size']} per process, {st['warmup']} warm-up +"
            f" {st['steps']} timed steps per run, {st['repeats']} interleaved repeat(s). Median of per-run medians"
            f" [min - max]; ratios per repeat. Throughput: {unit}/s of the global batch"
            f" (2 x {st['batch_size']}{tokens}) at a run's median step time. `gradient_as_bucket_view`: ds_mirrored"
            " True (its default); Lightning ddp and the plain DDP loop "
            + ("True (like for like)." if view else "False (torch's default: not like for like)."),
            "",
            *harness.markdown_table(["strategy", "step (ms)", f"{unit}/s"], rows),
            "",
            *harness.markdown_table(comp_head, comp_rows),
            *loopback_lines(s, "ds_mirrored", st),
            *(["", "Failed runs:", *(f"- {f}" for f in failed)] if failed else []),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        panels = [
            Panel("step_ms", "median step time (ms)"),
            Panel("throughput", f"{unit_of(data)} per second"),
            Panel("comm_bytes_per_step", "payload per step per rank (bytes, counted)", log=True),
        ]
        title = f"ds_mirrored on the {data['workload_label']}, 2 CPU processes (median, min-max over repeats)"
        path = out / f"{self.file_stem(data['settings'])}.png"
        colors = {a: f"C{i}" for i, a in enumerate(data["arms"])}  # an arm keeps its colour in every panel
        harness.bar_panels(path, {a: data["summary"][a] for a in data["arms"]}, panels, title, colors)
        return [path]


if __name__ == "__main__":
    harness.main(Mirrored())
