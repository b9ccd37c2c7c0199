"""ds_parameter_server against ds_mirrored with one of 2 workers a straggler; question, method, targets: README.md.

python -m benchmarks.parameter_server.driver [--quick] [--model digits|gpt] [--steps N] [--slowdown 3] ...
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

WORKER = Path(__file__).resolve().parent / "worker.py"
WORKERS, SLOW_RANK = 2, 1
TARGET_ASYNC_SPEEDUP = 1.5  # async samples/s over ds_mirrored's, under the straggler
TARGET_ACC_POINTS = 2.0  # final accuracy within this many points of ds_mirrored's
TARGET_PPL_RATIO = 1.05  # GPT: final validation perplexity at most this times ds_mirrored's
TARGET_BSP_STEP = 1.3  # max_staleness=0 step time over ds_mirrored's, no straggler
PHASES = ("sleep", "before_step", "step_backward", "after_backward")  # as the worker splits a step
MIRRORED, BSP, ASYNC, NO = "ds_mirrored", "ps_staleness_0", "ps_async", "no_straggler/"
STRAGGLER: dict[str, dict[str, Any]] = {
    MIRRORED: {"strategy": "ds_mirrored"},
    BSP: {"strategy": "ds_parameter_server", "max_staleness": 0},
    "ps_staleness_4": {"strategy": "ds_parameter_server", "max_staleness": 4},
    ASYNC: {"strategy": "ds_parameter_server", "max_staleness": None},
}
NO_STRAGGLER = {NO + MIRRORED: STRAGGLER[MIRRORED], NO + BSP: STRAGGLER[BSP]}
LABELS = {
    n: "ds_mirrored" if n == MIRRORED else f"ds_parameter_server max_staleness={c['max_staleness']}"
    for n, c in STRAGGLER.items()
}
# Per workload: a full run, then what --quick changes.
FULL = {
    "digits": {"steps": 120, "eval_every": 10, "batch": 32, "lr": 0.05},
    "gpt": {"steps": 12, "eval_every": 4, "batch": 8, "lr": 1e-3},
}
QUICK = {"digits": {"steps": 30, "eval_every": 5}, "gpt": {"steps": 6, "eval_every": 3}}
KEYS = [
    *("samples_per_s", "samples", "final_acc", "final_ppl", "step_ms_w0", "step_ms_w1", "busy_ms_w1"),
    *("steps_w0", "steps_w1", "slow_over_fast_step"),
    *(f"{p}_ms_w{w}" for p in PHASES for w in range(WORKERS)),
]


def unit(settings: dict[str, Any]) -> tuple[str, int]:
    """What throughput counts and how many of it a sample holds: samples (digits) or tokens (the GPT's context)."""
    return ("tokens", int(settings["gpt_block"])) if settings.get("model") == "gpt" else ("samples", 1)


def reading(found: dict[str, Any]) -> dict[str, Any]:
    """Throughput over the training phase of all workers together; step times and phases per worker; rank 0's curve."""
    ranks = [found.get(f"result.{r}") for r in range(WORKERS)]
    if None in ranks:
        raise harness.Failed(f"exit code {found['rc']}, only {[k for k in found if k != 'rc']} written")
    samples = sum(r["samples"] for r in ranks)  # the final parameters have seen every worker's pushes
    wall = max(r["last_end"] for r in ranks) - min(r["first_start"] for r in ranks)
    out = {"rc": found["rc"], "samples": samples, "train_s": wall, "samples_per_s": samples / wall}
    out["slow_over_fast_step"] = ranks[SLOW_RANK]["median_step_ms"] / ranks[0]["median_step_ms"]
    out["busy_ms_w1"] = ranks[1]["median_busy_ms"]
    out.update({k: ranks[0].get(k) for k in ("curve", "final_acc", "final_ppl", "eval_s")})
    for w, r in enumerate(ranks):
        out.update({f"steps_w{w}": r["steps"], f"step_ms_w{w}": r["median_step_ms"]})
        out.update({f"{p}_ms_w{w}": r["phase_ms"][p] for p in PHASES})
    return out


def group(summary: dict[str, Any], arms: dict[str, Any]) -> dict[str, Any]:
    """The summary of ``arms`` (straggler or not), keyed by the configuration's name."""
    return {a.removeprefix(NO): summary[a] for a in arms if a in summary}


class ParameterServer(harness.Benchmark):
    name = "parameter_server"
    description = __doc__
    models = ("digits", "gpt")

    def options(self, parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--steps", type=int, help="ds_mirrored steps per worker (120; GPT 12)")
        add("--eval-every", type=int, help="rank 0 evaluates every N steps (10; GPT 4)")
        add("--batch", type=int, help="samples per worker and step (32; GPT 8 windows)")
        add("--lr", type=float, help="SGD lr (0.05), AdamW for the GPT (1e-3)")
        add("--val-windows", type=int, default=16, help="GPT: validation windows evaluated (16)")
        add("--delay-ms-per-sample", type=float, help="the straggler's sleep (calibrated)")
        add("--slowdown", type=float, default=3.0, help="how much slower the straggler's step is (3)")
        add("--timeout", type=float, default=300.0, help="seconds one launch may take (300)")
        add("--dist-timeout", type=int, default=120, help="seconds any collective or reply may wait")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        _workloads.fill_defaults(opts, FULL, QUICK)
        return {"workload": _workloads.label(_workloads.spec_of(opts), [128])}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [
            Arm(n, {**c, "straggler": False}, f"{LABELS[n.removeprefix(NO)]}, no straggler")
            for n, c in NO_STRAGGLER.items()
        ]
        arms += [Arm(n, {**c, "straggler": True}, LABELS[n]) for n, c in STRAGGLER.items()]
        return Experiment(arms, opts.repeats)

    def launch(self, config: dict[str, Any], delay_ms: float, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {"max_staleness": None, **config, "workload": _workloads.spec_of(opts), "val_windows": opts.val_windows}
        spec.update(batch_size=opts.batch, steps=opts.steps, seed=0, dist_timeout=opts.dist_timeout, hidden=[128])
        spec.update(slow_rank=SLOW_RANK, delay_per_sample=delay_ms / 1000, eval_every=opts.eval_every, lr=opts.lr)
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1), outputs="result.*.json")
        return reading(found)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        return self.launch(arm.params, opts.delay_ms_per_sample if arm.params["straggler"] else 0.0, opts)

    def progress(self, r: dict[str, Any]) -> str:
        final = f"ppl {r['final_ppl']:.2f}" if r.get("final_ppl") is not None else f"acc {r['final_acc']:.4f}"
        return f"{r['samples_per_s']:7.1f} samples/s, steps {r['steps_w0']}/{r['steps_w1']}, final {final}"

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        """The straggler's sleep first: (slowdown - 1) x an un-delayed ds_mirrored step, from a calibration run."""
        calibration: dict[str, Any] = {"source": "--delay-ms-per-sample"}
        if opts.delay_ms_per_sample is None:
            try:
                run = self.launch(STRAGGLER[MIRRORED], 0.0, opts)
            except harness.Failed as exc:
                raise SystemExit(f"the calibration run (ds_mirrored without straggler) failed: {exc}") from exc
            step_ms = run["step_ms_w0"]
            opts.delay_ms_per_sample = (opts.slowdown - 1) * step_ms / opts.batch
            calibration = {"source": "a ds_mirrored run without straggler", "undelayed_step_ms": step_ms, "run": run}
        delay = opts.delay_ms_per_sample
        calibration.update(delay_ms_per_sample=delay, delay_ms_per_step=delay * opts.batch)
        return {"calibration": calibration, **super().collect(opts)}

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        records = data["records"]
        s = harness.summarise(records, list(data["arms"]), KEYS)
        for base, arms in ((MIRRORED, STRAGGLER), (NO + MIRRORED, NO_STRAGGLER)):
            for arm in (a for a in arms if a != base):
                s[arm]["samples_per_s_ratio"] = harness.paired(records, arm, base, "samples_per_s")
                s[arm]["acc_points"] = harness.paired(records, arm, base, "final_acc", lambda x, y: 100 * (x - y))
                s[arm]["final_ppl_ratio"] = harness.paired(records, arm, base, "final_ppl")
                s[arm]["step_ms_w0_ratio"] = harness.paired(records, arm, base, "step_ms_w0")
        gpt = unit(data["settings"])[0] == "tokens"
        what = "async throughput vs ds_mirrored under the straggler"
        judged = [harness.judged(what, s[ASYNC]["samples_per_s_ratio"], at_least=TARGET_ASYNC_SPEEDUP, unit="x")]
        for name in (ASYNC, "ps_staleness_4", BSP):
            if gpt:
                what = f"final validation perplexity of {LABELS[name]} vs ds_mirrored at equal tokens"
                judged.append(harness.judged(what, s[name]["final_ppl_ratio"], at_most=TARGET_PPL_RATIO, unit="x"))
            else:
                what = f"final accuracy of {LABELS[name]} vs ds_mirrored at equal samples"
                judged.append(harness.judged(what, s[name]["acc_points"], at_least=-TARGET_ACC_POINTS, unit=" points"))
        what = "max_staleness=0 step time vs ds_mirrored, no straggler"
        judged.append(harness.judged(what, s[NO + BSP]["step_ms_w0_ratio"], at_most=TARGET_BSP_STEP, unit="x"))
        return {**s, "verdicts": judged}

    def report(self, data: dict[str, Any]) -> list[str]:
        st, cal = data["settings"], data["calibration"]
        s, n = group(data["summary"], STRAGGLER), group(data["summary"], NO_STRAGGLER)
        what, per_sample = unit(st)
        gpt, batch = what == "tokens", st["batch"]

        def label(name: str, v: dict[str, Any]) -> str:
            return LABELS[name] + (f" ({v['failed_runs']} failed)" if v["failed_runs"] else "")

        if gpt:
            model = f"{data['workload']} (AdamW lr {st['lr']:g}), batch {batch} windows of {per_sample} tokens"
            final_figure = f"validation perplexity on the first {st['val_windows']} validation windows"
            final_heads, final = (
                ["final val perplexity", "vs ds_mirrored"],
                [("final_ppl", ".2f", 1), ("final_ppl_ratio", ".3f", 1)],
            )
        else:
            model = f"DigitsClassifier 64-128-10 (SGD lr {st['lr']:g} momentum 0.9), batch {batch}"
            final_figure = "validation accuracy"
            final_heads, final = (
                ["final val acc", "vs ds_mirrored (points)"],
                [("final_acc", ".1f", 100), ("acc_points", "+.1f", 1)],
            )
        straggler_rows = [
            [
                label(name, v),
                fmt(v["samples_per_s"], ".0f", per_sample),
                fmt(v.get("samples_per_s_ratio"), ".2f"),
                *(fmt(v.get(k), f, scale) for k, f, scale in final),
                f"{fmt(v['step_ms_w0'], '.1f')} / {fmt(v['step_ms_w1'], '.1f')}",
            ]
            for name, v in s.items()
        ]
        return [
            f"2 CPU workers, {model} per worker, {st['steps']} ds_mirrored steps per worker ="
            f" {WORKERS * st['steps'] * batch * per_sample} training {what} per run, {st['repeats']} interleaved"
            f" repeat(s); worker {SLOW_RANK} sleeps {cal['delay_ms_per_sample']:.3f} ms/sample before each step."
            f" Final figure: {final_figure} of rank 0's final parameters. Median [min - max] over repeats; ratios per"
            " repeat. Method: [the README](../parameter_server/README.md).",
            "",
            "**With the straggler**",
            "",
            *harness.markdown_table(
                ["configuration", f"{what}/s", "vs ds_mirrored", *final_heads, "median step w0 / w1 (ms)"],
                straggler_rows,
            ),
            "",
            "**Without a straggler**",
            "",
            *harness.markdown_table(
                ["configuration", "median step w0 (ms)", "vs ds_mirrored"],
                [
                    [label(k, v), fmt(v["step_ms_w0"], ".1f"), fmt(v.get("step_ms_w0_ratio"), ".2f")]
                    for k, v in n.items()
                ],
            ),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        final = ("final_ppl", "final validation perplexity") if unit(data["settings"])[0] == "tokens" else None
        panels = [
            Panel("samples_per_s", "samples/s (GPT: windows/s)", "samples_per_s_ratio"),
            Panel(*(final or ("final_acc", "final validation accuracy")), "final_ppl_ratio" if final else ""),
            Panel("step_ms_w0", "median step time, rank 0 (ms)", "step_ms_w0_ratio"),
        ]
        title = f"{data['workload']}: worker {SLOW_RANK} {data['settings']['slowdown']:g}x slower (median, min-max)"
        path = out / f"{harness.stem(self, data['settings'].get('model'))}.png"
        harness.bar_panels(path, {a: data["summary"][a] for a in data["arms"]}, panels, title)
        return [path]


if __name__ == "__main__":
    harness.main(ParameterServer())
