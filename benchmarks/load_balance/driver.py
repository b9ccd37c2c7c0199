"""With one of 2 processes 2x slower per sample, how much epoch time does DynamicLoadBalancer save over an equal split?

The arms, the workloads, the calibration, what is measured, the target and the options: README.md in this folder.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, fmt
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.figures import save_figure

WORKER = Path(__file__).resolve().parent / "worker.py"
SLOW_RANK = 1
HIDDEN = [1024, 1024]
VAL_WINDOWS = 32  # GPT: validation windows the final perplexity is taken on
DIST_TIMEOUT = 120  # seconds any collective may wait
#: the options left unset, per model: a full run, then --quick (a GPT run stays well under a minute)
FULL = {
    "digits": {"epochs": 10, "warmup_epochs": 3, "global_batch": 512, "lr": 0.05},
    "gpt": {"epochs": 3, "warmup_epochs": 2, "global_batch": 16, "lr": 1e-3, "limit_train_batches": 8},
}
QUICK = {
    "digits": {"epochs": 1, "limit_train_batches": 10},
    "gpt": {"epochs": 1, "warmup_epochs": 1, "limit_train_batches": 6},
}
TARGET_RATIO = 0.75  # balanced epoch time over the equal split's
EQUAL, BALANCED = "equal", "balanced"
LABELS = {EQUAL: "equal split (interval=0)", BALANCED: "DynamicLoadBalancer"}
COLORS = {EQUAL: "tab:gray", BALANCED: "tab:blue"}
KEYS = ("epoch_s", "first_epoch_s", "step_ms", "compute_ms_per_sample_r0", "compute_ms_per_sample_r1")
KEYS += ("slow_over_fast_per_sample", "final_share_rank0", "final_acc", "final_ppl")


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
    out = {"rc": found["rc"], "epoch_s": statistics.median(timed), "first_epoch_s": epochs[0] if epochs else None}
    out.update(timed_epochs=len(timed), step_ms=statistics.median(steps) if steps else None)
    out.update(compute_ms_per_sample_r0=per_sample(fast), compute_ms_per_sample_r1=per_sample(slow))
    out.update(slow_over_fast_per_sample=per_sample(slow) / per_sample(fast), final_sizes=fast["final_sizes"])
    out.update(final_share_rank0=fast["final_sizes"][0] / sum(fast["final_sizes"]), estimate=fast["estimate"])
    out.update(final_acc=fast.get("final_acc"), final_ppl=fast.get("final_ppl"), epochs=epochs)
    return {**out, "step_ms_trace": fast["step_ms"], "sizes_trace": fast["sizes"]}


def per_model(opts: argparse.Namespace) -> argparse.Namespace:
    return _workloads.fill_defaults(opts, FULL, QUICK)


def unit(settings: dict[str, Any]) -> tuple[str, int]:
    """What throughput counts and how many of it a sample holds: samples (digits) or tokens (the GPT's context)."""
    if settings.get("model", "digits") == "gpt":
        return "tokens", int(settings["gpt_block"])
    return "samples", 1


def global_batch(settings: dict[str, Any]) -> str:
    what, per_sample = unit(settings)
    return f"global batch {settings['global_batch']}" + (f" windows of {per_sample} tokens" if what == "tokens" else "")


class LoadBalance(harness.Benchmark):
    name = "load_balance"
    description = __doc__
    models = ("digits", "gpt")

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--epochs", type=int, help="timed epochs per run (10; GPT 3; 1 with --quick)")
        parser.add_argument("--warmup-epochs", type=int, help="epochs left out of the timing (3; GPT 2)")
        parser.add_argument("--global-batch", type=int, help="samples per step (512; GPT 16 windows)")
        parser.add_argument("--limit-train-batches", type=int, help="batches per epoch (digits all 23; GPT 8)")
        parser.add_argument("--lr", type=float, help="SGD lr for the digits (0.05), AdamW for the GPT (1e-3)")
        parser.add_argument("--interval", type=int, default=3, help="the balanced run's re-division interval (3)")
        parser.add_argument("--slowdown", type=float, default=2.0, help="how much slower rank 1 is per sample (2)")
        parser.add_argument("--delay-ms-per-sample", type=float, help="rank 1's sleep per sample (default: calibrated)")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take (600)")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        per_model(opts)
        return {"workload": _workloads.label(_workloads.spec_of(opts), HIDDEN)}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [
            Arm(EQUAL, {"interval": 0}, LABELS[EQUAL]),
            Arm(BALANCED, {"interval": opts.interval}, LABELS[BALANCED]),
        ]
        return Experiment(arms, opts.repeats, baseline=EQUAL)

    def launch(self, interval: int, delay: float, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {"global_batch_size": opts.global_batch, "interval": interval, "seed": 0, "slow_rank": SLOW_RANK}
        spec.update(epochs=opts.warmup_epochs + opts.epochs, limit_train_batches=opts.limit_train_batches)
        spec.update(dist_timeout=DIST_TIMEOUT, delay_per_sample=delay, hidden=HIDDEN, lr=opts.lr)
        spec.update(workload=_workloads.spec_of(opts), val_windows=VAL_WINDOWS)
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1), outputs="result.*.json")
        return reading(found, opts.warmup_epochs)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        return self.launch(arm.params["interval"], opts.delay_ms_per_sample / 1000, opts)

    def progress(self, r: dict[str, Any]) -> str:
        final = f"final ppl {r['final_ppl']:.2f}" if r.get("final_ppl") is not None else f"acc {r['final_acc']:.4f}"
        return (
            f"median epoch {r['epoch_s']:.3f} s, median step {r['step_ms']:.1f} ms, final sizes {r['final_sizes']},"
            f" rank 1 / rank 0 per sample x{r['slow_over_fast_per_sample']:.2f}, {final}"
        )

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        calibration: dict[str, Any] = {"source": "--delay-ms-per-sample"}
        if opts.delay_ms_per_sample is None:
            try:
                run = self.launch(0, 0.0, opts)
            except harness.Failed as exc:
                raise SystemExit(f"the calibration run (equal split, no sleep) failed: {exc}") from exc
            # Both ranks do the same work without the sleep; the slower one was the more disturbed by other load.
            per_sample = min(run["compute_ms_per_sample_r0"], run["compute_ms_per_sample_r1"])
            opts.delay_ms_per_sample = (opts.slowdown - 1) * per_sample
            calibration = {"source": "calibration run (equal split, no sleep)", "run": run}
            calibration["undelayed_compute_ms_per_sample"] = per_sample
            print(f"  calibrated: rank {SLOW_RANK} sleeps {opts.delay_ms_per_sample:.3f} ms/sample", flush=True)
        calibration["delay_ms_per_sample"] = opts.delay_ms_per_sample
        return {"calibration": calibration, **super().collect(opts)}

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        records = data["records"]
        s = harness.summarise(records, list(data["arms"]), KEYS, EQUAL)
        for arm in data["arms"]:
            s[arm]["final_sizes"] = harness.values(records, arm, "final_sizes")
            # throughput: the global batch per median step (a balancer keeps the global batch fixed)
            per_s = harness.values(records, arm, lambda r: 1000 * data["settings"]["global_batch"] / r["step_ms"])
            s[arm]["per_s"] = harness.spread(per_s)
        s[BALANCED]["final_ppl_ratio"] = harness.paired(records, BALANCED, EQUAL, "final_ppl")
        s[BALANCED]["acc_points"] = harness.paired(records, BALANCED, EQUAL, "final_acc", lambda a, b: 100 * (a - b))
        what = "epoch time with DynamicLoadBalancer vs equal split (ideal 0.667x)"
        s["verdicts"] = [harness.judged(what, s[BALANCED]["epoch_s_ratio"], at_most=TARGET_RATIO, unit="x")]
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, cal, st, b = data["summary"], data["calibration"], data["settings"], data["summary"][BALANCED]
        what, per_sample = unit(st)
        gpt = what == "tokens"
        limit = f", {st['limit_train_batches']} batches per epoch" if st["limit_train_batches"] else ""
        how = "."
        if "undelayed_compute_ms_per_sample" in cal:  # calibrated: say from what
            how = f" ((slowdown {st['slowdown']:g} - 1) x the calibration run's un-delayed compute per sample,"
            how += f" {cal['undelayed_compute_ms_per_sample']:.3f} ms; fixed for the whole benchmark)."
        rows = []
        for name in (EQUAL, BALANCED):
            v = s[name]
            row = [LABELS[name] + (f" ({v['failed_runs']} failed)" if v["failed_runs"] else "")]
            row += [fmt(v["epoch_s"], ".3f"), fmt(v["first_epoch_s"], ".3f"), fmt(v["step_ms"], ".1f")]
            row += [f"{fmt(v['compute_ms_per_sample_r0'], '.3f')} / {fmt(v['compute_ms_per_sample_r1'], '.3f')}"]
            row += [fmt(v["slow_over_fast_per_sample"], ".2f"), fmt(v["final_share_rank0"], ".3f")]
            row += [", ".join(str(x) for x in v["final_sizes"]) or "-", fmt(v.get("per_s"), ".0f", per_sample)]
            rows.append([*row, fmt(v.get("final_ppl"), ".2f") if gpt else fmt(v["final_acc"], ".1f", 100)])
        ratios = [["epoch time", fmt(b["epoch_s_ratio"], ".3f")]]
        ratios.append(["median step time, rank 0", fmt(b["step_ms_ratio"], ".3f")])
        if gpt:
            model = f"{data['workload']} (AdamW lr {st['lr']:g}), {global_batch(st)}"
            ratios.append(["final val perplexity (ratio)", fmt(b.get("final_ppl_ratio"), ".3f")])
        else:
            hidden = "-".join(str(h) for h in HIDDEN)
            model = f"DigitsClassifier 64-{hidden}-10 (SGD lr {st['lr']:g} momentum 0.9), {global_batch(st)}"
            ratios.append(["final val acc (points)", fmt(b["acc_points"], "+.1f")])
        head = ["configuration", "epoch (s)", "first epoch (s)", "median step, rank 0 (ms)"]
        head += ["compute/sample rank 0 / rank 1 (ms)", "rank 1 / rank 0 per sample", "final rank-0 share"]
        head += ["final sizes", f"{what}/s", "final val perplexity" if gpt else "final val acc (%)"]
        return [
            f"2 CPU processes (gloo, 1 thread each) under ds_mirrored, {model}, {st['warmup_epochs']} warm-up +"
            f" {st['epochs']} timed epoch(s){limit}, {st['repeats']} interleaved repeat(s). Balancer: interval"
            f" {st['interval']}, ema 0.5, hysteresis 0.05. Straggler: rank {SLOW_RANK} sleeps"
            f" {cal['delay_ms_per_sample']:.3f} ms per sample of its share in `training_step`{how}",
            "Epoch time: rank 0's, median over a run's timed epochs; then median [min - max] over repeats, ratios and"
            " differences per repeat. How each column is measured: [the README](../load_balance/README.md).",
            "",
            *harness.markdown_table(head, rows),
            "",
            *harness.markdown_table(["balanced / equal, per repeat", "median [min - max]"], ratios),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        """Rank 0's share and step time against the step, every run of both arms."""
        import matplotlib  # here: running the benchmark needs no matplotlib until it writes

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        st = data["settings"]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True)
        steps_per_epoch, timed = 0, []
        for name in (EQUAL, BALANCED):
            ax1.plot([], [], color=COLORS[name], label=LABELS[name])
            for i, run in enumerate(harness.ok(data["records"], name)):
                shares = [sizes[0] / sum(sizes) for sizes in run["sizes_trace"]]
                ax1.plot(range(len(shares)), shares, color=COLORS[name], alpha=0.8, lw=1.2, drawstyle="steps-post")
                trace = run["step_ms_trace"]
                ax2.plot(trace, color=COLORS[name], alpha=0.6, lw=0.9, label=None if i else LABELS[name])
                steps_per_epoch = len(trace) // max(1, len(run["epochs"]))
                timed += trace[1:]
        ax1.axhline(2 / 3, color="k", ls=":", lw=1, label="ideal rank-0 share (2/3)")
        for ax in (ax1, ax2):
            for e in range(1, st["warmup_epochs"] + st["epochs"]):
                ax.axvline(e * steps_per_epoch, color="k", alpha=0.15, lw=0.8)
            ax.axvspan(0, st["warmup_epochs"] * steps_per_epoch, color="k", alpha=0.05, lw=0)
            ax.grid(alpha=0.3)
        if timed:  # the first step (allocation, DDP set-up) is many times longer than the rest
            ax2.set_ylim(0, 3 * statistics.median(timed))
        ax1.set(ylabel="rank 0's share of the global batch", ylim=(0.4, 0.9))
        ax1.legend(fontsize=8, loc="lower right")
        ratio = data["summary"][BALANCED]["epoch_s_ratio"]
        title = f"{data['workload'].split(' on ')[0]}\nrank {SLOW_RANK} {st['slowdown']:g}x slower per sample,"
        title += f" {global_batch(st)}"
        if ratio:
            title += f"; epoch time balanced / equal {ratio['median']:.3f} (target <= {TARGET_RATIO})"
        ax1.set_title(f"{title}\nevery repeat; lines: epoch boundaries; shaded: warm-up (not timed)", fontsize=10)
        ax2.set(ylabel="step time, rank 0 (ms; first step off the chart)", xlabel="step")
        ax2.legend(fontsize=8, loc="upper right")
        fig.tight_layout()
        save_figure(fig, path := out / f"{self.file_stem(st)}.png")
        return [path]


if __name__ == "__main__":
    harness.main(LoadBalance())
