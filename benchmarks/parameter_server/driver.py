"""ds_parameter_server against ds_mirrored with one of 2 workers a straggler: the arms, the calibration, the summary,
the targets, the tables and the chart. The question, the method and the targets are in README.md.

    python -m benchmarks.parameter_server.driver [--quick] [--model digits|gpt] [--steps N] [--slowdown 3] ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, fmt
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.figures import save_figure

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
        parser.add_argument("--steps", type=int, default=None, help="ds_mirrored steps per worker (120; GPT 12)")
        parser.add_argument("--eval-every", type=int, default=None, help="rank 0 evaluates every N steps (10; GPT 4)")
        parser.add_argument("--batch", type=int, default=None, help="samples per worker and step (32; GPT 8 windows)")
        parser.add_argument("--lr", type=float, default=None, help="SGD lr (0.05), AdamW for the GPT (1e-3)")
        parser.add_argument("--val-windows", type=int, default=16, help="GPT: validation windows evaluated (16)")
        parser.add_argument(
            "--delay-ms-per-sample", type=float, default=None, help="the straggler's sleep (calibrated)"
        )
        parser.add_argument("--slowdown", type=float, default=3.0, help="how much slower the straggler's step is (3)")
        parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take (300)")
        parser.add_argument("--dist-timeout", type=int, default=120, help="seconds any collective or reply may wait")
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
        final = (
            f"final ppl {r['final_ppl']:.2f}" if r.get("final_ppl") is not None else f"final acc {r['final_acc']:.4f}"
        )
        return (
            f"{r['samples_per_s']:7.1f} samples/s, steps {r['steps_w0']}/{r['steps_w1']}, median step"
            f" {r['step_ms_w0']:.1f}/{r['step_ms_w1']:.1f} ms, {final}"
        )

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
            print(f"  straggler: worker {SLOW_RANK} sleeps {opts.delay_ms_per_sample:.3f} ms/sample", flush=True)
        calibration.update(delay_ms_per_sample=opts.delay_ms_per_sample)
        calibration["delay_ms_per_step"] = opts.delay_ms_per_sample * opts.batch
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
        what = "async throughput vs ds_mirrored under the straggler"
        judged = [harness.judged(what, s[ASYNC]["samples_per_s_ratio"], at_least=TARGET_ASYNC_SPEEDUP, unit="x")]
        for name in (ASYNC, "ps_staleness_4", BSP):
            if unit(data["settings"])[0] == "tokens":
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

        def failed(v: dict[str, Any]) -> str:
            return f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""

        def final(v: dict[str, Any]) -> list[str]:
            if gpt:
                return [fmt(v.get("final_ppl"), ".2f"), fmt(v.get("final_ppl_ratio"), ".3f")]
            return [fmt(v["final_acc"], ".1f", 100), fmt(v.get("acc_points"), "+.1f")]

        straggler_rows = [
            [
                LABELS[name] + failed(v),
                fmt(v["samples_per_s"], ".0f", per_sample),
                fmt(v.get("samples_per_s_ratio"), ".2f"),
                *final(v),
                fmt(v["samples"], ".0f", per_sample),
                f"{fmt(v['steps_w0'], '.0f')} / {fmt(v['steps_w1'], '.0f')}",
                f"{fmt(v['step_ms_w0'], '.1f')} / {fmt(v['step_ms_w1'], '.1f')}",
                fmt(v["slow_over_fast_step"], ".2f"),
            ]
            for name, v in s.items()
        ]
        phase_rows = [
            [g, LABELS[name], w, *(fmt(v[f"{p}_ms_w{w}"], ".1f") for p in PHASES), fmt(v[f"step_ms_w{w}"], ".1f")]
            for g, summary in (("straggler", s), ("no straggler", n))
            for name, v in summary.items()
            for w in range(WORKERS)
        ]
        if gpt:
            model = (
                f"{data['workload']} (AdamW lr {st['lr']:g}), batch {batch} windows of {per_sample} tokens per worker"
            )
            final_figure = (
                f"Final figure: validation perplexity of rank 0's final parameters on the first {st['val_windows']}"
                " validation windows (the same for every configuration). With max_staleness 4 or None every push is"
                " one server update of one worker's batch, so at equal tokens those runs make twice the AdamW updates"
                " of ds_mirrored and max_staleness=0, each on half the batch."
            )
        else:
            model = f"DigitsClassifier 64-128-10 (SGD lr {st['lr']:g} momentum 0.9), batch {batch} per worker"
            final_figure = "Final figure: validation accuracy of rank 0's final parameters."
        undelayed = cal.get("undelayed_step_ms")
        final_heads = (
            ["final val perplexity", "perplexity vs ds_mirrored"]
            if gpt
            else ["final val acc", "acc vs ds_mirrored (points)"]
        )
        return [
            f"2 CPU workers (gloo, 1 thread each; ds_parameter_server adds 1 server process), {model},"
            f" {st['steps']} ds_mirrored steps per worker = {WORKERS * st['steps'] * batch * per_sample} training"
            f" {what} per run under every configuration, {st['repeats']}"
            f" interleaved repeat(s). Straggler: worker {SLOW_RANK} sleeps {cal['delay_ms_per_sample']:.3f} ms/sample"
            f" ({cal['delay_ms_per_step']:.1f} ms per step) before each step"
            + (f", {st['slowdown']:g}x the un-delayed ds_mirrored step of {undelayed:.1f} ms." if undelayed else "."),
            "Median [min - max] over repeats; ratios and differences are taken per repeat against that repeat's"
            f" ds_mirrored run. {what.capitalize()}/s: {what} pushed by all workers / (last step end - first step"
            f" start). {final_figure}",
            "",
            "**With the straggler**",
            "",
            *harness.markdown_table(
                [
                    "configuration",
                    f"{what}/s",
                    "vs ds_mirrored",
                    *final_heads,
                    what,
                    *["steps w0 / w1", "median step w0 / w1 (ms)", "w1 / w0 step"],
                ],
                straggler_rows,
            ),
            "",
            "**Without a straggler**",
            "",
            *harness.markdown_table(
                ["configuration", "median step w0 (ms)", "vs ds_mirrored"],
                [
                    [LABELS[k] + failed(v), fmt(v["step_ms_w0"], ".1f"), fmt(v.get("step_ms_w0_ratio"), ".2f")]
                    for k, v in n.items()
                ],
            ),
            "",
            "**Where each worker's step goes** (median ms): the straggler's sleep; up to `training_step` (the pull"
            " under ds_parameter_server, a BSP pull waits for the other worker); `training_step` + backward (under"
            " ds_mirrored including the gradient all-reduce, which waits for the other worker); after backward (the"
            " push under ds_parameter_server, the optimizer step under ds_mirrored).",
            "",
            *harness.markdown_table(
                [
                    "run",
                    "configuration",
                    "worker",
                    "sleep",
                    "before training_step",
                    "training_step + backward",
                    "after backward",
                    "whole step",
                ],
                phase_rows,
            ),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        """Accuracy (perplexity on the GPT) against samples, throughput with the straggler, step time without."""
        import matplotlib  # here: running the benchmark needs no matplotlib until it writes

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        s, n = group(data["summary"], STRAGGLER), group(data["summary"], NO_STRAGGLER)
        what, per_sample = unit(data["settings"])
        gpt = what == "tokens"
        scale = 1.0 if gpt else 100.0  # perplexity as it is, accuracy in %
        colors = dict(zip(STRAGGLER, ["tab:blue", "tab:orange", "tab:green", "tab:red"], strict=True))
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [2.2, 1.4, 0.8]})
        for name in STRAGGLER:
            for i, run in enumerate(harness.ok(data["records"], name)):
                xs, ys = zip(*run["curve"], strict=True)
                style = "--" if name == BSP else "-"  # ds_mirrored's numerics: the two curves coincide
                label = None if i else name
                ax1.plot(
                    [x * per_sample for x in xs],
                    [scale * y for y in ys],
                    style,
                    color=colors[name],
                    alpha=0.75,
                    lw=1.2,
                    label=label,
                )
                final = run.get("final_ppl" if gpt else "final_acc")
                if final is not None:
                    ax1.plot(run["samples"] * per_sample, scale * final, "o", color=colors[name], ms=4)
        figure = "validation perplexity" if gpt else "validation accuracy (%)"
        ax1.set(xlabel=f"training {what} seen (all workers)", ylabel=f"{figure}, rank 0's parameters")
        if gpt:
            ax1.set_yscale("log")  # from 256 (uniform bytes) down to tens
        else:
            ax1.set_ylim(50, 100)
        ax1.set_title(
            f"with a {data['settings']['slowdown']:g}x straggler: {figure} vs {what} (every repeat; dot = final)"
        )
        ax1.legend(fontsize=8, loc="upper right" if gpt else "lower right")
        ax1.grid(alpha=0.3)
        _bars(ax2, s, "samples_per_s", per_sample, TARGET_ASYNC_SPEEDUP, "target for async", colors)
        ax2.set(ylabel=f"{what}/s (median, min-max)", title="throughput with the straggler")
        _bars(ax3, n, "step_ms_w0", 1, TARGET_BSP_STEP, "target for staleness 0", colors)
        ax3.set(ylabel="median step time, rank 0 (ms)", title="no straggler")
        fig.tight_layout()
        path = out / f"{harness.stem(self, data['settings'].get('model'))}.png"
        save_figure(fig, path)
        return [path]


def _bars(
    ax: Any, summary: dict[str, Any], key: str, scale: float, target: float, label: str, colors: dict[str, str]
) -> None:
    """A bar per configuration (median, min-max), its ratio to ds_mirrored above it, the target as a line."""
    names = [k for k in summary if summary[k][key]]
    spreads = [summary[k][key] for k in names]
    med = [scale * v["median"] for v in spreads]
    err = [
        [m - scale * v["min"] for m, v in zip(med, spreads, strict=True)],
        [scale * v["max"] - m for m, v in zip(med, spreads, strict=True)],
    ]
    ax.bar(range(len(names)), med, yerr=err, capsize=4, color=[colors[k] for k in names])
    for i, k in enumerate(names):
        if summary[k].get(f"{key}_ratio"):
            top = (i, scale * spreads[i]["max"])
            ax.annotate(f"{summary[k][f'{key}_ratio']['median']:.2f}x", top, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [k.replace("_", "\n", 2) for k in names], fontsize=7)
    if summary.get(MIRRORED, {}).get(key):
        ax.axhline(target * scale * summary[MIRRORED][key]["median"], color="k", ls=":", lw=1, label=label)
        ax.legend(fontsize=8)


if __name__ == "__main__":
    harness.main(ParameterServer())
