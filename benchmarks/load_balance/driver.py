"""With one of 2 processes 2x slower per sample, how much epoch time does DynamicLoadBalancer save over an equal split?

Trains the digits classifier (``DigitsClassifier``, 64-1024-1024-10, SGD lr 0.05 momentum 0.9) on 2 CPU processes
(gloo, 1 thread each) under ds_mirrored with a global batch of ``--global-batch`` (512: large enough that per-sample
compute, not the fixed per-step cost of Lightning and the all-reduce, dominates a step). Rank 1 is made 2x slower per
sample by a sleep of ``delay_per_sample`` x its share of the batch inside ``training_step``. Two configurations, both
through the balancer's data path: *equal split* (``DynamicLoadBalancer(G, interval=0, initial_shares=[1, 1])``: G/2
samples per rank throughout) and *balanced* (``DynamicLoadBalancer(G, interval=--interval, initial_shares=[1, 1])``:
shares follow measured throughput). Target (from the issue): epoch time with the balancer at most 0.75x the equal
split's; the ideal
is 2/3 (rank 0 takes 2/3 of the batch).

Method. The sleep per sample is (slowdown - 1) x the un-delayed compute time per sample: the median over steps of
(batch start to the launch of the last gradient bucket) / 32, the balancer's own measure of compute, taken from a first
calibration run (equal split, no sleep; the smaller of the two ranks' figures, as other load on the machine only ever
inflates it). Sleeping costs no CPU. The sleep stays fixed for the whole benchmark, so the tables also give the
slowdown per sample actually measured in every run. Epoch time is rank 0's wall time from the epoch's start
to the end of its last batch (no validation runs during fit); the first ``--warmup-epochs`` epochs are left out (there
the balancer converges from the equal split) and each run's figure is the median of its remaining epochs. Runs are
separate launches, equal and balanced alternating repeat by repeat (the machine is noisy); the tables give medians over
repeats, the balanced / equal ratio per repeat and the min-max spread. Validation accuracy of the final parameters is
measured on rank 0 after fit. The PNG plots rank 0's share and step time against the step for both configurations.

With ``--model gpt`` the workload is the byte-level GPT on the standard library's source text
(``harness.workloads``), AdamW lr 1e-3, a global batch of 16 windows of 128 tokens, 2 warm-up + 3 timed epochs of 8
batches (1 + 1 of 6 with --quick); throughput is in tokens/s and the final figure is the validation perplexity on the
first ``--val-windows`` (32) validation windows. Results go to ``results/load_balance_gpt.*``.

    python -m benchmarks.load_balance.driver [--quick] [--repeats 3] [--out DIR] [--render [JSON]] [--model digits|gpt]
        [--epochs 10] [--warmup-epochs 3] [--interval 3] [--global-batch 512] [--limit-train-batches N] [--lr 0.05]
        [--slowdown 2] [--delay-ms-per-sample MS] [--hidden 1024 1024] [--val-windows 32] [--timeout 600]
        [--dist-timeout 120] [--gpt-layers 4 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, fmt
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.figures import save_figure

WORKER = Path(__file__).resolve().parent / "worker.py"
SLOW_RANK = 1
#: per-model values of the options left ``None`` (full run, then ``--quick``): a GPT run stays well under a minute
PER_MODEL: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "digits": (
        {"epochs": 10, "warmup_epochs": 3, "global_batch": 512, "lr": 0.05},
        {"epochs": 1, "limit_train_batches": 10},
    ),
    "gpt": (
        {"epochs": 3, "warmup_epochs": 2, "global_batch": 16, "lr": 1e-3, "limit_train_batches": 8},
        {"epochs": 1, "warmup_epochs": 1, "limit_train_batches": 6},
    ),
}
TARGET_RATIO = 0.75  # balanced epoch time over the equal split's
EQUAL = "equal"
BALANCED = "balanced"
LABELS = {EQUAL: "equal split (interval=0)", BALANCED: "DynamicLoadBalancer"}
COLORS = {EQUAL: "tab:gray", BALANCED: "tab:blue"}
KEYS = (
    "epoch_s",
    "first_epoch_s",
    "step_ms",
    "compute_ms_per_sample_r0",
    "compute_ms_per_sample_r1",
    "slow_over_fast_per_sample",
    "final_share_rank0",
    "final_acc",
    "final_ppl",
)


def reading(found: dict[str, Any], warmup_epochs: int) -> dict[str, Any]:
    """Rank 0's epoch and step times; both ranks' compute time per sample over the timed epochs; the shares."""
    ranks = [found.get(f"result.{r}") for r in range(2)]
    if None in ranks:
        raise harness.Failed(f"exit code {found['rc']}, only {[k for k in found if k != 'rc']} written")
    fast, slow = ranks
    epochs = fast["epoch_s"]
    timed = epochs[warmup_epochs:] or epochs[-1:]
    steps_per_epoch = len(fast["step_ms"]) // max(1, len(epochs))
    first_timed = warmup_epochs * steps_per_epoch if len(epochs) > warmup_epochs else 0

    def per_sample(record: dict[str, Any]) -> float:
        pairs = list(zip(record["compute_ms"], record["local_sizes"], strict=True))[first_timed:]
        return statistics.median(c / n for c, n in pairs if n > 0)

    steps = fast["step_ms"][first_timed:]
    return {
        "rc": found["rc"],
        "epoch_s": statistics.median(timed),
        "first_epoch_s": epochs[0] if epochs else None,
        "timed_epochs": len(timed),
        "step_ms": statistics.median(steps) if steps else None,
        "compute_ms_per_sample_r0": per_sample(fast),
        "compute_ms_per_sample_r1": per_sample(slow),
        "slow_over_fast_per_sample": per_sample(slow) / per_sample(fast),
        "final_sizes": fast["final_sizes"],
        "final_share_rank0": fast["final_sizes"][0] / sum(fast["final_sizes"]),
        "estimate": fast["estimate"],
        "final_acc": fast.get("final_acc"),
        "final_ppl": fast.get("final_ppl"),
        "epochs": epochs,
        "step_ms_trace": fast["step_ms"],
        "sizes_trace": fast["sizes"],
    }


def per_model(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left ``None`` with the workload's full or ``--quick`` values."""
    return _workloads.fill_defaults(
        opts, {m: d[0] for m, d in PER_MODEL.items()}, {m: d[1] for m, d in PER_MODEL.items()}
    )


def unit(settings: dict[str, Any]) -> tuple[str, int]:
    """What throughput counts and how many of it a sample holds: samples (digits) or tokens (the GPT's context)."""
    if settings.get("model", "digits") == "gpt":
        return "tokens", int(settings.get("gpt_block", _workloads.GPT_DEFAULTS["block_size"]))
    return "samples", 1


class LoadBalance(harness.Benchmark):
    name = "load_balance"
    description = __doc__
    models = ("digits", "gpt")
    defaults = {"repeats": 3}  # the rest per model: PER_MODEL, filled in by meta()
    quick = {"repeats": 1}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--epochs", type=int, default=None, help="timed epochs per run (10; GPT 3; 1 with --quick)")
        parser.add_argument("--warmup-epochs", type=int, default=None, help="epochs left out of the timing (3; GPT 2)")
        parser.add_argument("--global-batch", type=int, default=None, help="samples per step (512; GPT 16 windows)")
        parser.add_argument(
            "--limit-train-batches",
            type=int,
            default=None,
            help="batches per epoch (digits all 23; GPT 8; quick 10/6)",
        )
        parser.add_argument(
            "--lr", type=float, default=None, help="SGD lr for the digits (0.05), AdamW for the GPT (1e-3)"
        )
        parser.add_argument("--val-windows", type=int, default=32, help="GPT: validation windows evaluated (32)")
        parser.add_argument("--interval", type=int, default=3, help="the balanced run's re-division interval (3)")
        parser.add_argument("--slowdown", type=float, default=2.0, help="how much slower rank 1 is per sample (2)")
        parser.add_argument(
            "--delay-ms-per-sample", type=float, default=None, help="rank 1's sleep per sample (default: calibrated)"
        )
        parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024], help="hidden widths (1024 1024)")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take (600)")
        parser.add_argument("--dist-timeout", type=int, default=120, help="seconds any collective may wait (120)")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        per_model(opts)
        return {"workload": _workloads.label(_workloads.spec_of(opts), opts.hidden)}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [
            Arm(EQUAL, {"interval": 0}, LABELS[EQUAL]),
            Arm(BALANCED, {"interval": opts.interval}, LABELS[BALANCED]),
        ]
        return Experiment(arms, opts.repeats, baseline=EQUAL)

    def launch(self, interval: int, delay: float, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {
            "global_batch_size": opts.global_batch,
            "interval": interval,
            "epochs": opts.warmup_epochs + opts.epochs,
            "limit_train_batches": opts.limit_train_batches,
            "seed": 0,
            "dist_timeout": opts.dist_timeout,
            "slow_rank": SLOW_RANK,
            "delay_per_sample": delay,
            "hidden": opts.hidden,
            "lr": opts.lr,
            "workload": _workloads.spec_of(opts),
            "val_windows": opts.val_windows,
        }
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1), outputs="result.*.json")
        return reading(found, opts.warmup_epochs)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        return self.launch(arm.params["interval"], opts.delay_ms_per_sample / 1000, opts)

    def progress(self, r: dict[str, Any]) -> str:
        final = (
            f"final ppl {r['final_ppl']:.2f}" if r.get("final_ppl") is not None else f"final acc {r['final_acc']:.4f}"
        )
        return (
            f"median epoch {r['epoch_s']:.3f} s, median step {r['step_ms']:.1f} ms, final sizes {r['final_sizes']},"
            f" compute/sample {r['compute_ms_per_sample_r0']:.3f}/{r['compute_ms_per_sample_r1']:.3f} ms"
            f" (x{r['slow_over_fast_per_sample']:.2f}), {final}"
        )

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        calibration: dict[str, Any] = {"source": "--delay-ms-per-sample"}
        if opts.delay_ms_per_sample is None:
            try:
                run = self.launch(0, 0.0, opts)
            except harness.Failed as exc:
                raise SystemExit(f"the calibration run (equal split, no sleep) failed: {exc}") from exc
            print(f"  calibrate (equal split, no sleep): {self.progress(run)}", flush=True)
            # Both ranks do the same work without the sleep; the slower one was the more disturbed by other load.
            per_sample = min(run["compute_ms_per_sample_r0"], run["compute_ms_per_sample_r1"])
            opts.delay_ms_per_sample = (opts.slowdown - 1) * per_sample
            calibration = {
                "source": "calibration run (equal split, no sleep)",
                "undelayed_compute_ms_per_sample": per_sample,
                "run": run,
            }
            print(
                f"  straggler: rank {SLOW_RANK} sleeps {opts.delay_ms_per_sample:.3f} ms/sample = ({opts.slowdown:g}"
                f" - 1) x the un-delayed {per_sample:.3f} ms/sample",
                flush=True,
            )
        calibration["delay_ms_per_sample"] = opts.delay_ms_per_sample
        return {"calibration": calibration, **super().collect(opts)}

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        records = data["records"]
        s = harness.summarise(records, list(data["arms"]), KEYS, EQUAL)
        for arm in s:
            s[arm]["final_sizes"] = harness.values(records, arm, "final_sizes")
        s[BALANCED]["final_ppl_ratio"] = harness.paired(records, BALANCED, EQUAL, "final_ppl")
        s[BALANCED]["acc_points"] = harness.paired(records, BALANCED, EQUAL, "final_acc", lambda a, b: 100 * (a - b))
        for arm in s:  # throughput: the global batch per median step (a balancer keeps the global batch fixed)
            s[arm]["per_s"] = harness.spread(
                harness.values(records, arm, lambda r: 1000 * data["settings"]["global_batch"] / r["step_ms"])
            )
        s["verdicts"] = [
            harness.judged(
                "epoch time with DynamicLoadBalancer vs equal split (ideal 0.667x)",
                s[BALANCED]["epoch_s_ratio"],
                at_most=TARGET_RATIO,
                unit="x",
            )
        ]
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, cal, st = data["summary"], data["calibration"], data["settings"]
        hidden = "-".join(str(h) for h in st["hidden"])
        what, per_sample = unit(st)
        gpt = what == "tokens"
        lr = st.get("lr") or 0.05  # older runs did not record it: the digits' 0.05
        limit = f", {st['limit_train_batches']} batches per epoch" if st["limit_train_batches"] else ""
        how = (
            f" (slowdown {st['slowdown']:g} - 1 = {st['slowdown'] - 1:g} x the un-delayed compute of"
            f" {cal['undelayed_compute_ms_per_sample']:.3f} ms/sample in the calibration run: batch start to the"
            " launch of the last gradient bucket, / local batch, median over steps, the smaller of the two ranks')."
            " The sleep is fixed for the whole benchmark: the 'rank 1 / rank 0 per sample' column gives the measured"
            " slowdown."
            if "undelayed_compute_ms_per_sample" in cal
            else "."
        )
        rows = []
        for name in (EQUAL, BALANCED):
            v = s[name]
            rows.append(
                [
                    LABELS[name] + (f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""),
                    fmt(v["epoch_s"], ".3f"),
                    fmt(v["first_epoch_s"], ".3f"),
                    fmt(v["step_ms"], ".1f"),
                    f"{fmt(v['compute_ms_per_sample_r0'], '.3f')} / {fmt(v['compute_ms_per_sample_r1'], '.3f')}",
                    fmt(v["slow_over_fast_per_sample"], ".2f"),
                    fmt(v["final_share_rank0"], ".3f"),
                    ", ".join(str(x) for x in v["final_sizes"]) or "-",
                    fmt(v.get("per_s"), ".0f", per_sample),
                    fmt(v.get("final_ppl"), ".2f") if gpt else fmt(v["final_acc"], ".1f", 100),
                ]
            )
        b = s[BALANCED]
        ratio = b["epoch_s_ratio"]
        met = s["verdicts"][0]["verdict"]
        model = (
            f"{data.get('workload', 'the GPT')} (AdamW lr {lr:g}), global batch {st['global_batch']} windows of"
            f" {per_sample} tokens"
            if gpt
            else f"DigitsClassifier 64-{hidden}-10 (SGD lr {lr:g} momentum 0.9), global batch {st['global_batch']}"
        )
        final = (
            ["final val perplexity (ratio)", fmt(b.get("final_ppl_ratio"), ".3f")]
            if gpt
            else ["final val acc (points)", fmt(b["acc_points"], "+.1f")]
        )
        return [
            f"2 CPU processes (gloo, 1 thread each) under ds_mirrored, {model}, {st['warmup_epochs']} warm-up +"
            f" {st['epochs']} timed epoch(s){limit}, {st['repeats']} interleaved repeat(s). Balancer: interval"
            f" {st['interval']}, ema 0.5, hysteresis 0.05. Straggler: rank {SLOW_RANK} sleeps"
            f" {cal['delay_ms_per_sample']:.3f} ms per sample of its share in `training_step`{how}",
            "Epoch time: rank 0, epoch start to the end of its last batch (the harness's `StepTimer`), median over"
            " the timed epochs of a run; then median [min - max] over repeats. Ratios and differences are per repeat."
            " Compute per sample: batch start to the launch of the last gradient bucket (what the balancer"
            f" measures), / local batch size. {what.capitalize()}/s: the global batch"
            + (f" x {per_sample} tokens" if gpt else "")
            + " / the median step time of rank 0 over the timed epochs."
            + (
                f" Final validation perplexity: the final parameters on the first {st.get('val_windows')} validation"
                " windows."
                if gpt
                else ""
            ),
            "",
            *harness.markdown_table(
                [
                    "configuration",
                    "epoch (s)",
                    "first epoch (s)",
                    "median step, rank 0 (ms)",
                    "compute/sample rank 0 / rank 1 (ms)",
                    "rank 1 / rank 0 per sample",
                    "final rank-0 share",
                    "final sizes",
                    f"{what}/s",
                    "final val perplexity" if gpt else "final val acc (%)",
                ],
                rows,
            ),
            "",
            *harness.markdown_table(
                ["balanced / equal, per repeat", "median [min - max]"],
                [
                    ["epoch time", fmt(ratio, ".3f")],
                    ["median step time, rank 0", fmt(b["step_ms_ratio"], ".3f")],
                    final,
                ],
            ),
            "",
            "**Target** (judged on the median)",
            "",
            *harness.markdown_table(
                ["target", "goal", "measured", "result"],
                [
                    [
                        "epoch time with DynamicLoadBalancer vs equal split (ideal 0.667x)",
                        f"<= {TARGET_RATIO}x",
                        fmt(ratio, ".3f"),
                        met,
                    ]
                ],
            ),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        path = out / f"{harness.stem(self, data['settings'].get('model'))}.png"
        plot(data, path)
        return [path]


def plot(data: dict[str, Any], path: Path) -> None:
    """Rank 0's share and step time against the step, every run of both arms."""
    import matplotlib  # here: running the benchmark needs no matplotlib until it writes

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = data["settings"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True)
    steps_per_epoch = 0
    for name in (EQUAL, BALANCED):
        runs = harness.ok(data["records"], name)
        for i, run in enumerate(runs):
            label = LABELS[name] if i == 0 else None
            shares = [sizes[0] / sum(sizes) for sizes in run["sizes_trace"]]
            ax1.plot(range(len(shares)), shares, color=COLORS[name], alpha=0.8, lw=1.2, drawstyle="steps-post")
            ax2.plot(
                range(len(run["step_ms_trace"])),
                run["step_ms_trace"],
                color=COLORS[name],
                alpha=0.6,
                lw=0.9,
                label=label,
            )
            steps_per_epoch = len(run["step_ms_trace"]) // max(1, len(run["epochs"]))
    ax1.axhline(2 / 3, color="k", ls=":", lw=1, label="ideal rank-0 share (2/3)")
    for name in (EQUAL, BALANCED):
        ax1.plot([], [], color=COLORS[name], label=LABELS[name])
    for ax in (ax1, ax2):
        for e in range(1, st["warmup_epochs"] + st["epochs"]):
            if steps_per_epoch:
                ax.axvline(e * steps_per_epoch, color="k", alpha=0.15, lw=0.8)
        ax.grid(alpha=0.3)
    timed = [t for n in (EQUAL, BALANCED) for r in harness.ok(data["records"], n) for t in r["step_ms_trace"][1:]]
    if timed:  # the first step (allocation, DDP set-up) is many times longer than the rest
        ax2.set_ylim(0, 3 * statistics.median(timed))
    if steps_per_epoch and st["warmup_epochs"]:
        for ax in (ax1, ax2):
            ax.axvspan(0, st["warmup_epochs"] * steps_per_epoch, color="k", alpha=0.05, lw=0)
    ax1.set_ylabel("rank 0's share of the global batch")
    ax1.set_ylim(0.4, 0.9)
    ax1.legend(fontsize=8, loc="lower right")
    ratio = data["summary"][BALANCED]["epoch_s_ratio"]
    what, per_sample = unit(st)
    title = f"{_workloads.label(_workloads.spec_of(argparse.Namespace(**st)), st['hidden']).split(' on ')[0]}\nrank"
    title += f" {SLOW_RANK} {st['slowdown']:g}x slower per sample, global batch {st['global_batch']}"
    if what == "tokens":
        title += f" windows of {per_sample} tokens"
    if ratio:
        title += f"; epoch time balanced / equal {ratio['median']:.3f} (target <= {TARGET_RATIO})"
    ax1.set_title(f"{title}\nevery repeat; lines: epoch boundaries; shaded: warm-up (not timed)", fontsize=10)
    ax2.set_ylabel("step time, rank 0 (ms; first step off the chart)")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    harness.main(LoadBalance())
