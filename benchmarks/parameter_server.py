"""Does ds_parameter_server beat ds_mirrored when one worker straggles, and what does it cost when none does?

Trains the digits classifier (``DigitsClassifier``, 64-128-10, SGD lr 0.05 momentum 0.9, batch 32 per worker) on 2 CPU
workers (1 thread each), worker 1 made 3x slower by a per-sample sleep before each of its steps, under ds_mirrored and
ds_parameter_server (1 server) with max_staleness 0, 4 and None; every configuration processes the same number of
training samples. Reports samples/s, validation accuracy against samples seen, and the step time of max_staleness=0 vs
ds_mirrored with no straggler. Configurations run as separate launches, interleaved repeat by repeat by the benchmark
harness (the machine is noisy); the tables give medians, ratios to ds_mirrored and the min-max spread.

Method. The straggler's sleep per sample is (slowdown - 1) x the un-delayed ds_mirrored step / batch, measured by a
calibration run first (ds_mirrored, no straggler); sleeping costs no CPU. Equal samples: ds_mirrored runs ``--steps``
steps per worker; ds_parameter_server gets ``max_updates`` = ``--steps`` (max_staleness=0: one update takes a batch from
every worker) or ``2 x --steps`` (otherwise: one batch per update), so fast workers do more steps. A push already in
flight when the budget runs out is still applied (one batch more at most); the real totals are used. Samples/s: samples
of all workers / (last step end - first step start). Accuracy: rank 0 evaluates its current parameters (under
ds_parameter_server the last pulled ones) on the validation split every ``--eval-every`` steps with no collectives;
samples seen come from the servers' update count. The classifier's epoch-level ``train_acc`` is kept local
(``sync_on_compute=False``) under every strategy: its all-gather at each epoch end would re-synchronise
ds_parameter_server's workers once per epoch.

    python benchmarks/parameter_server.py [--quick] [--repeats 3] [--out DIR] [--render [JSON]] [--steps 150]
        [--eval-every 10] [--slowdown 3] [--delay-ms-per-sample MS] [--timeout 300] [--dist-timeout 120]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, fmt

WORKER = Path(__file__).resolve().parent / "_parameter_server_worker.py"
BATCH = 32
WORKERS = 2
SLOW_RANK = 1
TARGET_ASYNC_SPEEDUP = 1.5  # async samples/s over ds_mirrored's, under the straggler
TARGET_ACC_POINTS = 2.0  # final accuracy within this many points of ds_mirrored's
TARGET_BSP_STEP = 1.3  # max_staleness=0 step time over ds_mirrored's, no straggler
PHASES = ("sleep", "before_step", "step_backward", "after_backward")  # as the worker splits a step
MIRRORED = "ds_mirrored"
ASYNC = "ps_async"
BSP = "ps_staleness_0"
NO = "no_straggler/"  # the prefix of the arms without a straggler
STRAGGLER: dict[str, dict[str, Any]] = {
    MIRRORED: {"strategy": "ds_mirrored"},
    BSP: {"strategy": "ds_parameter_server", "max_staleness": 0},
    "ps_staleness_4": {"strategy": "ds_parameter_server", "max_staleness": 4},
    ASYNC: {"strategy": "ds_parameter_server", "max_staleness": None},
}
NO_STRAGGLER = {NO + MIRRORED: STRAGGLER[MIRRORED], NO + BSP: STRAGGLER[BSP]}
LABELS = {
    MIRRORED: "ds_mirrored",
    BSP: "ds_parameter_server max_staleness=0",
    "ps_staleness_4": "ds_parameter_server max_staleness=4",
    ASYNC: "ds_parameter_server max_staleness=None",
}
KEYS = [
    "samples_per_s",
    "samples",
    "final_acc",
    "step_ms_w0",
    "step_ms_w1",
    "busy_ms_w1",
    "steps_w0",
    "steps_w1",
    "slow_over_fast_step",
    *(f"{p}_ms_w{w}" for p in PHASES for w in range(WORKERS)),
]


def reading(found: dict[str, Any]) -> dict[str, Any]:
    """Throughput over the training phase of all workers together; step times and phases per worker; rank 0's curve."""
    ranks = [found.get(f"result.{r}") for r in range(WORKERS)]
    if None in ranks:
        raise harness.Failed(f"exit code {found['rc']}, only {[k for k in found if k != 'rc']} written")
    samples = sum(r["samples"] for r in ranks)
    wall = max(r["last_end"] for r in ranks) - min(r["first_start"] for r in ranks)
    out = {
        "rc": found["rc"],
        "samples": samples,  # the final parameters have seen every worker's pushes
        "train_s": wall,
        "samples_per_s": samples / wall,
        "slow_over_fast_step": ranks[SLOW_RANK]["median_step_ms"] / ranks[0]["median_step_ms"],
        "busy_ms_w1": ranks[1]["median_busy_ms"],
        "curve": ranks[0]["curve"],
        "final_acc": ranks[0]["final_acc"],
        "eval_s": ranks[0]["eval_s"],
    }
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
    defaults = {"repeats": 3, "steps": 150, "eval_every": 10}
    quick = {"repeats": 1, "steps": 30, "eval_every": 5}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=None, help="ds_mirrored steps per worker: every run's samples")
        parser.add_argument("--eval-every", type=int, default=None, help="rank 0 evaluates every this many steps (10)")
        parser.add_argument(
            "--delay-ms-per-sample", type=float, default=None, help="the straggler's sleep per sample (calibrated)"
        )
        parser.add_argument("--slowdown", type=float, default=3.0, help="how much slower the straggler's step is (3)")
        parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take (300)")
        parser.add_argument("--dist-timeout", type=int, default=120, help="seconds any collective or reply may wait")

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [
            Arm(n, {**c, "straggler": False}, f"{LABELS[n.removeprefix(NO)]}, no straggler")
            for n, c in NO_STRAGGLER.items()
        ]
        arms += [Arm(n, {**c, "straggler": True}, LABELS[n]) for n, c in STRAGGLER.items()]
        return Experiment(arms, opts.repeats)

    def launch(self, config: dict[str, Any], delay_ms: float, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {
            "max_staleness": None,
            **config,
            "batch_size": BATCH,
            "steps": opts.steps,
            "seed": 0,
            "dist_timeout": opts.dist_timeout,
            "slow_rank": SLOW_RANK,
            "delay_per_sample": delay_ms / 1000,
            "eval_every": opts.eval_every,
            "hidden": [128],
            "lr": 0.05,
        }
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1), outputs="result.*.json")
        return reading(found)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        return self.launch(arm.params, opts.delay_ms_per_sample if arm.params["straggler"] else 0.0, opts)

    def progress(self, r: dict[str, Any]) -> str:
        return (
            f"{r['samples_per_s']:7.0f} samples/s, steps {r['steps_w0']}/{r['steps_w1']}, median step"
            f" {r['step_ms_w0']:.1f}/{r['step_ms_w1']:.1f} ms, final acc {r['final_acc']:.4f}"
        )

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        calibration: dict[str, Any] = {"source": "--delay-ms-per-sample"}
        if opts.delay_ms_per_sample is None:
            try:
                run = self.launch(STRAGGLER[MIRRORED], 0.0, opts)
            except harness.Failed as exc:
                raise SystemExit(f"the calibration run (ds_mirrored without straggler) failed: {exc}") from exc
            step_ms = run["step_ms_w0"]
            opts.delay_ms_per_sample = (opts.slowdown - 1) * step_ms / BATCH
            calibration = {"source": "a ds_mirrored run without straggler", "undelayed_step_ms": step_ms, "run": run}
            print(
                f"  straggler: worker {SLOW_RANK} sleeps {opts.delay_ms_per_sample:.3f} ms/sample ="
                f" {opts.delay_ms_per_sample * BATCH:.1f} ms per step of {BATCH} ({opts.slowdown:g}x the"
                f" {step_ms:.1f} ms un-delayed ds_mirrored step)",
                flush=True,
            )
        calibration.update(
            delay_ms_per_sample=opts.delay_ms_per_sample, delay_ms_per_step=opts.delay_ms_per_sample * BATCH
        )
        return {"calibration": calibration, **super().collect(opts)}

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        records = data["records"]
        s = harness.summarise(records, list(data["arms"]), KEYS)
        for base, arms in ((MIRRORED, STRAGGLER), (NO + MIRRORED, NO_STRAGGLER)):
            for arm in (a for a in arms if a != base):
                s[arm]["samples_per_s_ratio"] = harness.paired(records, arm, base, "samples_per_s")
                s[arm]["acc_points"] = harness.paired(records, arm, base, "final_acc", lambda x, y: 100 * (x - y))
                s[arm]["step_ms_w0_ratio"] = harness.paired(records, arm, base, "step_ms_w0")
        return s

    def targets(self, data: dict[str, Any]) -> list[list[str]]:
        s, rows = data["summary"], []

        def row(label: str, value: dict[str, Any] | None, ok: bool | None, goal: str, f: str = ".2f") -> None:
            result = {True: "PASS", False: "**MISS**", None: "no data"}[None if value is None else ok]
            rows.append([label, goal, fmt(value, f), result])

        v = s[ASYNC]["samples_per_s_ratio"]
        row(
            "async throughput vs ds_mirrored under the straggler",
            v,
            v and v["median"] >= TARGET_ASYNC_SPEEDUP,
            f">= {TARGET_ASYNC_SPEEDUP}x",
        )
        for name in (ASYNC, "ps_staleness_4", BSP):
            v = s[name]["acc_points"]
            row(
                f"final accuracy of {LABELS[name]} vs ds_mirrored at equal samples",
                v,
                v and v["median"] >= -TARGET_ACC_POINTS,
                f"at most {TARGET_ACC_POINTS:g} points below",
                "+.1f",
            )
        v = s[NO + BSP]["step_ms_w0_ratio"]
        row(
            "max_staleness=0 step time vs ds_mirrored, no straggler",
            v,
            v and v["median"] <= TARGET_BSP_STEP,
            f"<= {TARGET_BSP_STEP}x",
        )
        return rows

    def report(self, data: dict[str, Any]) -> list[str]:
        st, cal = data["settings"], data["calibration"]
        s, n = group(data["summary"], STRAGGLER), group(data["summary"], NO_STRAGGLER)

        def failed(v: dict[str, Any]) -> str:
            return f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""

        straggler_rows = [
            [
                LABELS[name] + failed(v),
                fmt(v["samples_per_s"], ".0f"),
                fmt(v.get("samples_per_s_ratio"), ".2f"),
                fmt(v["final_acc"], ".1f", 100),
                fmt(v.get("acc_points"), "+.1f"),
                fmt(v["samples"], ".0f"),
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
        return [
            f"2 CPU workers (gloo, 1 thread each; ds_parameter_server adds 1 server process), DigitsClassifier"
            f" 64-128-10, batch {BATCH} per worker, {st['steps']} ds_mirrored steps per worker ="
            f" {WORKERS * st['steps'] * BATCH} training samples per run under every configuration, {st['repeats']}"
            f" interleaved repeat(s). Straggler: worker {SLOW_RANK} sleeps {cal['delay_ms_per_sample']:.3f} ms/sample"
            f" ({cal['delay_ms_per_step']:.1f} ms per step) before each step"
            + (
                f", {st['slowdown']:g}x the un-delayed ds_mirrored step of {cal['undelayed_step_ms']:.1f} ms."
                if "undelayed_step_ms" in cal
                else "."
            ),
            "Median [min - max] over repeats; ratios and differences are taken per repeat against that repeat's"
            " ds_mirrored run. Samples/s: samples pushed by all workers / (last step end - first step start).",
            "",
            "**With the straggler**",
            "",
            *harness.markdown_table(
                [
                    "configuration",
                    "samples/s",
                    "vs ds_mirrored",
                    "final val acc",
                    "acc vs ds_mirrored (points)",
                    "samples",
                    "steps w0 / w1",
                    "median step w0 / w1 (ms)",
                    "w1 / w0 step",
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
            "",
            "**Targets** (judged on the median)",
            "",
            *harness.markdown_table(["target", "goal", "measured", "result"], self.targets(data)),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        plot(data, out / "parameter_server.png")
        return [out / "parameter_server.png"]


def plot(data: dict[str, Any], path: Path) -> None:
    """Accuracy against samples, throughput with the straggler, step time without."""
    import matplotlib  # here: running the benchmark needs no matplotlib until it writes

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, n = group(data["summary"], STRAGGLER), group(data["summary"], NO_STRAGGLER)
    slowdown = data["settings"]["slowdown"]
    colors = dict(zip(STRAGGLER, ["tab:blue", "tab:orange", "tab:green", "tab:red"], strict=True))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [2.2, 1.4, 0.8]})
    for name in STRAGGLER:
        for i, run in enumerate(harness.ok(data["records"], name)):
            xs, ys = zip(*run["curve"], strict=True)
            style = "--" if name == BSP else "-"  # ds_mirrored's numerics: the two curves coincide
            ax1.plot(
                xs, [100 * y for y in ys], style, color=colors[name], alpha=0.75, lw=1.2, label=None if i else name
            )
            ax1.plot(run["samples"], 100 * run["final_acc"], "o", color=colors[name], ms=4)
    ax1.set_xlabel("training samples seen (all workers)")
    ax1.set_ylabel("validation accuracy (%), rank 0's parameters")
    ax1.set_ylim(50, 100)
    ax1.set_title(f"with a {slowdown:g}x straggler: accuracy vs samples (every repeat; dot = final)")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.grid(alpha=0.3)
    names = [k for k in s if s[k]["samples_per_s"]]
    med = [s[k]["samples_per_s"]["median"] for k in names]
    err = [
        [m - s[k]["samples_per_s"]["min"] for k, m in zip(names, med, strict=True)],
        [s[k]["samples_per_s"]["max"] - m for k, m in zip(names, med, strict=True)],
    ]
    ax2.bar(range(len(names)), med, yerr=err, capsize=4, color=[colors[k] for k in names])
    for i, k in enumerate(names):
        ratio = s[k].get("samples_per_s_ratio")
        if ratio:
            ax2.annotate(
                f"{ratio['median']:.2f}x", (i, s[k]["samples_per_s"]["max"]), ha="center", va="bottom", fontsize=8
            )
    ax2.set_xticks(range(len(names)), [k.replace("_", "\n", 2) for k in names], fontsize=7)
    ax2.set_ylabel("samples/s (median, min-max)")
    base = s.get(MIRRORED, {}).get("samples_per_s")
    if base:
        ax2.axhline(TARGET_ASYNC_SPEEDUP * base["median"], color="k", ls=":", lw=1, label="target for async")
        ax2.legend(fontsize=8)
    ax2.set_title("throughput with the straggler")
    nn = [k for k in n if n[k]["step_ms_w0"]]
    med = [n[k]["step_ms_w0"]["median"] for k in nn]
    err = [
        [m - n[k]["step_ms_w0"]["min"] for k, m in zip(nn, med, strict=True)],
        [n[k]["step_ms_w0"]["max"] - m for k, m in zip(nn, med, strict=True)],
    ]
    ax3.bar(range(len(nn)), med, yerr=err, capsize=4, color=[colors[k] for k in nn])
    for i, k in enumerate(nn):
        ratio = n[k].get("step_ms_w0_ratio")
        if ratio:
            ax3.annotate(
                f"{ratio['median']:.2f}x", (i, n[k]["step_ms_w0"]["max"]), ha="center", va="bottom", fontsize=8
            )
    ax3.set_xticks(range(len(nn)), [k.replace("_", "\n", 2) for k in nn], fontsize=7)
    base = n.get(MIRRORED, {}).get("step_ms_w0")
    if base:
        ax3.axhline(TARGET_BSP_STEP * base["median"], color="k", ls=":", lw=1, label="target for staleness 0")
        ax3.legend(fontsize=8)
    ax3.set_ylabel("median step time, rank 0 (ms)")
    ax3.set_title("no straggler")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    harness.main(ParameterServer())
