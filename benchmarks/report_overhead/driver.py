"""What does DistributedReport cost per training step under ds_mirrored (target: at most 3% of step time)?

The arms, the workload, what is measured, the target and the options: README.md in this folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, fmt

WORKER = Path(__file__).resolve().parent / "worker.py"
HIDDEN = [1024, 1024]
DIST_TIMEOUT = 120  # seconds any collective may wait
TARGET_RATIO = 1.03  # wall time per step with the report over without (issue 28)
PLAIN, REPORT = "plain", "report"
LABELS = {PLAIN: "no callback", REPORT: "DistributedReport(every_n_steps=50)"}
KEYS = ("wall_ms_per_step", "median_step_ms", "end_of_fit_s", "hook_ms_per_step", "hook_share")


def reading(found: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's wall time per step and median step; the slower rank's end-of-fit time; the verdict, if any."""
    ranks = [found.get(f"result.{r}") for r in range(2)]
    if None in ranks:
        raise harness.Failed(f"exit code {found['rc']}, only {[k for k in found if k != 'rc']} written")
    first = ranks[0]
    out = {"rc": found["rc"], "wall_ms_per_step": first["wall_ms_per_step"], "median_step_ms": first["median_step_ms"]}
    out["end_of_fit_s"] = max(r["end_of_fit_s"] for r in ranks)
    if "hook_ms_per_step" in first:  # the report's own time in its hooks, against the run's step
        out["hook_ms_per_step"] = max(r["hook_ms_per_step"] for r in ranks)
        out["hook_share"] = out["hook_ms_per_step"] / first["wall_ms_per_step"]
    out["verdict"] = first.get("verdict")
    return out


class ReportOverhead(harness.Benchmark):
    name = "report_overhead"
    description = __doc__
    defaults = {"repeats": 3, "steps": 400, "warmup_steps": 20}
    quick = {"repeats": 1, "steps": 60, "warmup_steps": 5}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, help="timed steps per launch (400; 60 with --quick)")
        parser.add_argument("--warmup-steps", type=int, help="steps before the timing starts (20; 5 with --quick)")
        parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (32)")
        parser.add_argument("--every-n-steps", type=int, default=50, help="the report's every_n_steps (50)")
        parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take (300)")

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        return {"workload": f"DigitsClassifier 64-{'-'.join(map(str, HIDDEN))}-10, batch {opts.batch_size} per rank"}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [Arm(PLAIN, {"report": False}, LABELS[PLAIN]), Arm(REPORT, {"report": True}, LABELS[REPORT])]
        return Experiment(arms, opts.repeats, baseline=PLAIN)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {"report": arm.params["report"], "seed": 0, "hidden": HIDDEN, "dist_timeout": DIST_TIMEOUT}
        spec.update(steps=opts.steps, warmup_steps=opts.warmup_steps, batch_size=opts.batch_size)
        spec.update(every_n_steps=opts.every_n_steps)
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1), outputs="result.*.json")
        return reading(found)

    def progress(self, r: dict[str, Any]) -> str:
        return (
            f"wall {r['wall_ms_per_step']:.2f} ms/step, median step {r['median_step_ms']:.2f} ms,"
            f" end of fit {r['end_of_fit_s']:.2f} s" + (f", verdict {r['verdict']}" if r.get("verdict") else "")
        )

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        s = harness.summarise(data["records"], list(data["arms"]), KEYS, PLAIN)
        what = "wall time per step with DistributedReport vs without"
        s["verdicts"] = [harness.judged(what, s[REPORT]["wall_ms_per_step_ratio"], at_most=TARGET_RATIO, unit="x")]
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, st = data["summary"], data["settings"]
        rows = []
        for name in (PLAIN, REPORT):
            v = s[name]
            row = [LABELS[name] + (f" ({v['failed_runs']} failed)" if v["failed_runs"] else "")]
            row += [fmt(v["wall_ms_per_step"], ".2f"), fmt(v["median_step_ms"], ".2f"), fmt(v["end_of_fit_s"], ".2f")]
            rows.append([*row, fmt(v["hook_ms_per_step"], ".3f"), fmt(v["hook_share"], ".2f", 100)])
        ratios = [
            ["wall time per step", fmt(s[REPORT]["wall_ms_per_step_ratio"], ".3f")],
            ["median step (batch start to end)", fmt(s[REPORT]["median_step_ms_ratio"], ".3f")],
        ]
        head = ["configuration", "wall ms / step", "median step (ms)", "end of fit (s)", "report's hooks (ms / step)"]
        head += ["report's hooks (% of step)"]
        return [
            f"2 CPU processes (gloo, 1 thread each) under ds_mirrored, {data['workload']}, {st['warmup_steps']}"
            f" warm-up + {st['steps']} timed steps, {st['repeats']} interleaved repeat(s); the report logs every"
            f" {st['every_n_steps']} steps and gathers and writes at the end of fit.",
            "Wall time per step: rank 0's, from the first timed batch's start to the last one's, over the steps between"
            " (every hook and the data loading included). End of fit: from `on_train_end` to `fit` returning, the"
            " slower rank. Report's hooks: the time spent inside its per-step hooks (the slower rank), which other"
            " load on the machine disturbs far less than a difference of two runs' step times."
            " Median [min - max] over launches; ratios per repeat."
            " [The README](../report_overhead/README.md).",
            "",
            *harness.markdown_table(head, rows),
            "",
            *harness.markdown_table(["report / no callback, per repeat", "median [min - max]"], ratios),
        ]


if __name__ == "__main__":
    harness.main(ReportOverhead())
