"""Does ds_parameter_server beat ds_mirrored when one worker straggles, and what does it cost when none does?

Trains the digits classifier (``DigitsClassifier``, 64-128-10, SGD lr 0.05 momentum 0.9, batch 32 per worker) on 2 CPU
workers (1 thread each), worker 1 made 3x slower by a per-sample sleep before each of its steps, under ds_mirrored and
ds_parameter_server (1 server) with max_staleness 0, 4 and None; every configuration processes the same number of
training samples. Reports samples/s, validation accuracy against samples seen, and the step time of max_staleness=0 vs
ds_mirrored with no straggler. Configurations run as separate launches, interleaved repeat by repeat by the benchmark
harness (the machine is noisy); the tables give medians, ratios to ds_mirrored and the min-max spread.

With ``--model gpt`` the workload is the byte-level GPT on the standard library's source text (``harness.workloads``),
AdamW lr 1e-3, 8 windows of 128 tokens per worker, 30 ds_mirrored steps per worker (12 with --quick); throughput is in
tokens/s and the final figure is the validation perplexity of rank 0's parameters on the first ``--val-windows`` (32)
validation windows, the same windows for every arm. Results go to ``results/parameter_server_gpt.*``.

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

    python -m benchmarks.parameter_server.driver [--quick] [--repeats 3] [--out DIR] [--render [JSON]]
        [--model digits|gpt]
        [--steps 150] [--eval-every 10] [--batch 32] [--lr 0.05] [--val-windows 32] [--slowdown 3]
        [--delay-ms-per-sample MS] [--timeout 300] [--dist-timeout 120] [--gpt-layers 4 ...]
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
from benchmarks.parameter_server.report import (
    ASYNC,
    BSP,
    LABELS,
    MIRRORED,
    NO,
    NO_STRAGGLER,
    PHASES,
    STRAGGLER,
    TARGET_ACC_POINTS,
    TARGET_ASYNC_SPEEDUP,
    TARGET_BSP_STEP,
    TARGET_PPL_RATIO,
    WORKERS,
    group,
    plot,
    unit,
)

WORKER = Path(__file__).resolve().parent / "worker.py"
#: per-model values of the options left ``None`` (full run, then ``--quick``): a GPT run stays well under a minute
PER_MODEL: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "digits": ({"steps": 150, "eval_every": 10, "batch": 32, "lr": 0.05}, {"steps": 30, "eval_every": 5}),
    "gpt": ({"steps": 30, "eval_every": 5, "batch": 8, "lr": 1e-3}, {"steps": 12, "eval_every": 4}),
}
SLOW_RANK = 1
KEYS = [
    "samples_per_s",
    "samples",
    "final_acc",
    "final_ppl",
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
        "final_acc": ranks[0].get("final_acc"),
        "final_ppl": ranks[0].get("final_ppl"),
        "eval_s": ranks[0]["eval_s"],
    }
    for w, r in enumerate(ranks):
        out.update({f"steps_w{w}": r["steps"], f"step_ms_w{w}": r["median_step_ms"]})
        out.update({f"{p}_ms_w{w}": r["phase_ms"][p] for p in PHASES})
    return out


def per_model(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left ``None`` with the workload's full or ``--quick`` values."""
    return _workloads.fill_defaults(
        opts, {m: d[0] for m, d in PER_MODEL.items()}, {m: d[1] for m, d in PER_MODEL.items()}
    )


def checks(s: dict[str, Any], gpt: bool) -> list[tuple[str, Any, dict[str, float], str, str, str]]:
    """Every target: what, the figure (a spread over repeats), its bound, the bound's unit, the goal as the page says
    it, and the figure's format."""
    out: list[tuple[str, Any, dict[str, float], str, str, str]] = [
        (
            "async throughput vs ds_mirrored under the straggler",
            s[ASYNC]["samples_per_s_ratio"],
            {"at_least": TARGET_ASYNC_SPEEDUP},
            "x",
            f">= {TARGET_ASYNC_SPEEDUP}x",
            ".2f",
        )
    ]
    for name in (ASYNC, "ps_staleness_4", BSP):
        if gpt:
            out.append(
                (
                    f"final validation perplexity of {LABELS[name]} vs ds_mirrored at equal tokens",
                    s[name].get("final_ppl_ratio"),
                    {"at_most": TARGET_PPL_RATIO},
                    "x",
                    f"<= {TARGET_PPL_RATIO}x",
                    ".3f",
                )
            )
        else:
            out.append(
                (
                    f"final accuracy of {LABELS[name]} vs ds_mirrored at equal samples",
                    s[name]["acc_points"],
                    {"at_least": -TARGET_ACC_POINTS},
                    " points",
                    f"at most {TARGET_ACC_POINTS:g} points below",
                    "+.1f",
                )
            )
    out.append(
        (
            "max_staleness=0 step time vs ds_mirrored, no straggler",
            s[NO + BSP]["step_ms_w0_ratio"],
            {"at_most": TARGET_BSP_STEP},
            "x",
            f"<= {TARGET_BSP_STEP}x",
            ".2f",
        )
    )
    return out


class ParameterServer(harness.Benchmark):
    name = "parameter_server"
    description = __doc__
    models = ("digits", "gpt")
    defaults = {"repeats": 3}  # the rest per model: PER_MODEL, filled in by meta()
    quick = {"repeats": 1}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=None, help="ds_mirrored steps per worker (150; GPT 30)")
        parser.add_argument("--eval-every", type=int, default=None, help="rank 0 evaluates every N steps (10; GPT 5)")
        parser.add_argument("--batch", type=int, default=None, help="samples per worker and step (32; GPT 8 windows)")
        parser.add_argument(
            "--lr", type=float, default=None, help="SGD lr for the digits (0.05), AdamW for the GPT (1e-3)"
        )
        parser.add_argument("--val-windows", type=int, default=32, help="GPT: validation windows evaluated (32)")
        parser.add_argument(
            "--delay-ms-per-sample", type=float, default=None, help="the straggler's sleep per sample (calibrated)"
        )
        parser.add_argument("--slowdown", type=float, default=3.0, help="how much slower the straggler's step is (3)")
        parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take (300)")
        parser.add_argument("--dist-timeout", type=int, default=120, help="seconds any collective or reply may wait")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        per_model(opts)
        return {"workload": _workloads.label(_workloads.spec_of(opts), [128])}

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
            "workload": _workloads.spec_of(opts),
            "val_windows": opts.val_windows,
            "batch_size": opts.batch,
            "steps": opts.steps,
            "seed": 0,
            "dist_timeout": opts.dist_timeout,
            "slow_rank": SLOW_RANK,
            "delay_per_sample": delay_ms / 1000,
            "eval_every": opts.eval_every,
            "hidden": [128],
            "lr": opts.lr,
        }
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
        calibration: dict[str, Any] = {"source": "--delay-ms-per-sample"}
        if opts.delay_ms_per_sample is None:
            try:
                run = self.launch(STRAGGLER[MIRRORED], 0.0, opts)
            except harness.Failed as exc:
                raise SystemExit(f"the calibration run (ds_mirrored without straggler) failed: {exc}") from exc
            step_ms = run["step_ms_w0"]
            opts.delay_ms_per_sample = (opts.slowdown - 1) * step_ms / opts.batch
            calibration = {"source": "a ds_mirrored run without straggler", "undelayed_step_ms": step_ms, "run": run}
            print(
                f"  straggler: worker {SLOW_RANK} sleeps {opts.delay_ms_per_sample:.3f} ms/sample ="
                f" {opts.delay_ms_per_sample * opts.batch:.1f} ms per step of {opts.batch} ({opts.slowdown:g}x the"
                f" {step_ms:.1f} ms un-delayed ds_mirrored step)",
                flush=True,
            )
        calibration.update(
            delay_ms_per_sample=opts.delay_ms_per_sample, delay_ms_per_step=opts.delay_ms_per_sample * opts.batch
        )
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
        s["verdicts"] = [harness.judged(what, value, **bound, unit=u) for what, value, bound, u, _, _ in checks(s, gpt)]
        return s

    def targets(self, data: dict[str, Any]) -> list[list[str]]:
        """The page's table of the targets, from the summary's verdicts."""
        s = data["summary"]
        listed = checks(s, unit(data["settings"])[0] == "tokens")
        return [
            [what, goal, fmt(value, f), v["verdict"]]
            for (what, value, _, _, goal, f), v in zip(listed, s["verdicts"], strict=True)
        ]

    def report(self, data: dict[str, Any]) -> list[str]:
        st, cal = data["settings"], data["calibration"]
        s, n = group(data["summary"], STRAGGLER), group(data["summary"], NO_STRAGGLER)
        what, per_sample = unit(st)
        gpt = what == "tokens"
        batch = st.get("batch", 32)  # older runs did not record it: the digits' 32

        def failed(v: dict[str, Any]) -> str:
            return f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""

        straggler_rows = [
            [
                LABELS[name] + failed(v),
                fmt(v["samples_per_s"], ".0f", per_sample),
                fmt(v.get("samples_per_s_ratio"), ".2f"),
                *(
                    [fmt(v.get("final_ppl"), ".2f"), fmt(v.get("final_ppl_ratio"), ".3f")]
                    if gpt
                    else [fmt(v["final_acc"], ".1f", 100), fmt(v.get("acc_points"), "+.1f")]
                ),
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
        model = (
            f"{data.get('workload', 'the GPT')} (AdamW lr {st.get('lr', 1e-3):g}), batch {batch} windows of"
            f" {per_sample} tokens per worker"
            if gpt
            else f"DigitsClassifier 64-128-10 (SGD lr {st.get('lr', 0.05):g} momentum 0.9), batch {batch} per worker"
        )
        final = (
            f"Final figure: validation perplexity of rank 0's final parameters on the first {st.get('val_windows')}"
            " validation windows (the same for every configuration). With max_staleness 4 or None every push is one"
            " server update of one worker's batch, so at equal tokens those runs make twice the AdamW updates of"
            " ds_mirrored and max_staleness=0, each on half the batch."
            if gpt
            else "Final figure: validation accuracy of rank 0's final parameters."
        )
        return [
            f"2 CPU workers (gloo, 1 thread each; ds_parameter_server adds 1 server process), {model},"
            f" {st['steps']} ds_mirrored steps per worker = {WORKERS * st['steps'] * batch * per_sample} training"
            f" {what} per run under every configuration, {st['repeats']}"
            f" interleaved repeat(s). Straggler: worker {SLOW_RANK} sleeps {cal['delay_ms_per_sample']:.3f} ms/sample"
            f" ({cal['delay_ms_per_step']:.1f} ms per step) before each step"
            + (
                f", {st['slowdown']:g}x the un-delayed ds_mirrored step of {cal['undelayed_step_ms']:.1f} ms."
                if "undelayed_step_ms" in cal
                else "."
            ),
            "Median [min - max] over repeats; ratios and differences are taken per repeat against that repeat's"
            f" ds_mirrored run. {what.capitalize()}/s: {what} pushed by all workers / (last step end - first step"
            f" start). {final}",
            "",
            "**With the straggler**",
            "",
            *harness.markdown_table(
                [
                    "configuration",
                    f"{what}/s",
                    "vs ds_mirrored",
                    *(
                        ["final val perplexity", "perplexity vs ds_mirrored"]
                        if gpt
                        else ["final val acc", "acc vs ds_mirrored (points)"]
                    ),
                    what,
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
        path = out / f"{harness.stem(self, data['settings'].get('model'))}.png"
        plot(data, path)
        return [path]


if __name__ == "__main__":
    harness.main(ParameterServer())
