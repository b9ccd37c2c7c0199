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

Writes ``load_balance.json``, ``load_balance.md`` and ``load_balance.png`` to ``results/`` (or ``--out``; ``--quick``
writes to a temporary folder unless ``--out`` is given).

    python benchmarks/load_balance.py [--quick] [--repeats 3] [--epochs 10] [--warmup-epochs 3] [--interval 3]
                                      [--global-batch 512]
                                      [--slowdown 2] [--delay-ms-per-sample MS] [--hidden 1024 1024]
                                      [--timeout 600] [--dist-timeout 120] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import package_state, run_detached, spread, worker_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
WORKER = HERE / "_load_balance_worker.py"

DEFAULT_GLOBAL_BATCH = 512  # large enough that per-sample compute, not the fixed per-step cost, dominates a step
WORKERS = 2
SLOW_RANK = 1
LR = 0.05
TARGET_RATIO = 0.75  # balanced epoch time over the equal split's
EQUAL = "equal"
BALANCED = "balanced"
LABELS = {EQUAL: "equal split (interval=0)", BALANCED: "DynamicLoadBalancer"}
COLORS = {EQUAL: "tab:gray", BALANCED: "tab:blue"}


# --- launching --------------------------------------------------------------------------------------------------------


def run_once(interval: int, delay_per_sample: float, opts: argparse.Namespace) -> dict[str, Any]:
    """One launch of 2 processes; both ranks' records merged, or an error."""
    with tempfile.TemporaryDirectory(prefix="ds-balance-bench-") as tmp:
        records = Path(tmp) / "records"
        records.mkdir()
        spec = {
            "global_batch_size": opts.global_batch,
            "interval": interval,
            "epochs": opts.warmup_epochs + opts.epochs,
            "limit_train_batches": opts.limit_train_batches,
            "seed": 0,
            "dist_timeout": opts.dist_timeout,
            "slow_rank": SLOW_RANK,
            "delay_per_sample": delay_per_sample,
            "hidden": opts.hidden,
            "lr": LR,
            "records": str(records),
        }
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = Path(tmp) / "log.txt"
        start = time.monotonic()
        rc: Any = run_detached(WORKER, spec_path, tmp, log_path, opts.timeout, worker_env())
        seconds = time.monotonic() - start
        tail = log_path.read_text(errors="replace")[-3000:]
        ranks = {}
        for rank in range(WORKERS):
            path = records / f"rank{rank}.json"
            if path.exists():
                ranks[rank] = json.loads(path.read_text())
        if len(ranks) < WORKERS or rc == "timeout":
            reason = f"timed out after {opts.timeout:.0f} s" if rc == "timeout" else f"exit code {rc}"
            errors = [line.strip() for line in tail.splitlines() if "Error" in line or "error" in line]
            if errors:
                reason += f", {errors[-1][:300]}"
            return {"error": reason, "log_tail": tail[-1500:], "launch_s": seconds}
        return merge(ranks, rc, seconds, opts.warmup_epochs)


def merge(ranks: dict[int, dict[str, Any]], rc: Any, seconds: float, warmup_epochs: int) -> dict[str, Any]:
    """Rank 0's epoch and step times; both ranks' compute time per sample over the timed epochs; the shares."""
    fast, slow = ranks[0], ranks[SLOW_RANK]
    epochs = fast["epoch_s"]
    timed = epochs[warmup_epochs:] or epochs[-1:]
    steps_per_epoch = len(fast["step_ms"]) // max(1, len(epochs))
    first_timed = warmup_epochs * steps_per_epoch if len(epochs) > warmup_epochs else 0

    def per_sample(record: dict[str, Any]) -> float:
        pairs = list(zip(record["compute_ms"], record["local_sizes"], strict=True))[first_timed:]
        return statistics.median(c / n for c, n in pairs if n > 0)

    def median_or_none(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {
        "exit_code": rc,
        "launch_s": seconds,
        "epoch_s": epochs,
        "median_epoch_s": statistics.median(timed),
        "timed_epochs": len(timed),
        "step_ms": fast["step_ms"],
        "median_step_ms": median_or_none(fast["step_ms"][first_timed:]),
        "compute_ms_per_sample": [per_sample(ranks[r]) for r in sorted(ranks)],
        "slow_over_fast_per_sample": per_sample(slow) / per_sample(fast),
        "median_compute_ms": [median_or_none(ranks[r]["compute_ms"][first_timed:]) for r in sorted(ranks)],
        "sizes": fast["sizes"],
        "final_sizes": fast["final_sizes"],
        "final_share_rank0": fast["final_sizes"][0] / sum(fast["final_sizes"]),
        "estimate": fast["estimate"],
        "final_acc": fast["final_acc"],
    }


def _print_run(r: int, repeats: int, name: str, result: dict[str, Any]) -> None:
    if "error" in result:
        print(f"  repeat {r + 1}/{repeats} {name:>11}: FAILED {result['error']}", flush=True)
        return
    print(
        f"  repeat {r + 1}/{repeats} {name:>11}: median epoch {result['median_epoch_s']:.3f} s,"
        f" median step {result['median_step_ms']:.1f} ms, final sizes {result['final_sizes']},"
        f" compute/sample {result['compute_ms_per_sample'][0]:.3f}/{result['compute_ms_per_sample'][1]:.3f} ms"
        f" (x{result['slow_over_fast_per_sample']:.2f}), final acc {result['final_acc']:.4f}"
        f" ({result['launch_s']:.0f} s launch)",
        flush=True,
    )


def run_all(opts: argparse.Namespace) -> dict[str, Any]:
    raw: dict[str, list[dict[str, Any]]] = {EQUAL: [], BALANCED: []}
    intervals = {EQUAL: 0, BALANCED: opts.interval}
    delay = None if opts.delay_ms_per_sample is None else opts.delay_ms_per_sample / 1000
    calibration: dict[str, Any] = {"source": "--delay-ms-per-sample"}
    if delay is None:
        result = run_once(0, 0.0, opts)
        _print_run(0, 1, "calibrate", result)
        if "error" in result:
            raise RuntimeError(f"the calibration run (equal split, no sleep) failed: {result['error']}")
        # Both ranks do the same work without the sleep; the slower one was the more disturbed by other load.
        per_sample_ms = min(result["compute_ms_per_sample"])
        delay = (opts.slowdown - 1) * per_sample_ms / 1000
        calibration = {
            "source": "calibration run (equal split, no sleep)",
            "undelayed_compute_ms_per_sample": per_sample_ms,
            "undelayed_compute_ms_per_sample_ranks": result["compute_ms_per_sample"],
            "undelayed_median_epoch_s": result["median_epoch_s"],
            "undelayed_median_step_ms": result["median_step_ms"],
            "run": result,
        }
        print(
            f"  straggler: rank {SLOW_RANK} sleeps {1000 * delay:.3f} ms/sample = ({opts.slowdown:g} - 1) x the"
            f" un-delayed {per_sample_ms:.3f} ms/sample; {1000 * delay * opts.global_batch / 2:.1f} ms per step at the"
            " equal split",
            flush=True,
        )
    calibration.update(delay_ms_per_sample=1000 * delay)
    names = [EQUAL, BALANCED]
    for r in range(opts.repeats):
        for name in names[r % 2 :] + names[: r % 2]:  # alternate which configuration runs first
            result = run_once(intervals[name], delay, opts)
            raw[name].append(result)
            _print_run(r, opts.repeats, name, result)
    return {"raw": raw, "calibration": calibration}


# --- statistics -------------------------------------------------------------------------------------------------------


def summarise(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, results in raw.items():
        ok = [r for r in results if "error" not in r]
        out[name] = {
            "failed_runs": len(results) - len(ok),
            "errors": [r["error"] for r in results if "error" in r],
            "epoch_s": spread([r["median_epoch_s"] for r in ok]),
            "first_epoch_s": spread([r["epoch_s"][0] for r in ok if r["epoch_s"]]),
            "step_ms": spread([r["median_step_ms"] for r in ok if r["median_step_ms"] is not None]),
            "compute_ms_per_sample_r0": spread([r["compute_ms_per_sample"][0] for r in ok]),
            "compute_ms_per_sample_r1": spread([r["compute_ms_per_sample"][1] for r in ok]),
            "slow_over_fast_per_sample": spread([r["slow_over_fast_per_sample"] for r in ok]),
            "final_share_rank0": spread([r["final_share_rank0"] for r in ok]),
            "final_sizes": [r["final_sizes"] for r in ok],
            "final_acc": spread([r["final_acc"] for r in ok]),
        }
    pairs = [(b, e) for b, e in zip(raw[BALANCED], raw[EQUAL], strict=True) if "error" not in b and "error" not in e]
    out["ratio_epoch"] = spread([b["median_epoch_s"] / e["median_epoch_s"] for b, e in pairs])
    out["ratio_step"] = spread(
        [b["median_step_ms"] / e["median_step_ms"] for b, e in pairs if b["median_step_ms"] and e["median_step_ms"]]
    )
    out["acc_points"] = spread([100 * (b["final_acc"] - e["final_acc"]) for b, e in pairs])
    return out


def verdicts(s: dict[str, Any]) -> list[dict[str, Any]]:
    value = s["ratio_epoch"]
    return [
        {
            "target": "epoch time with DynamicLoadBalancer vs equal split (ideal 0.667x)",
            "goal": f"<= {TARGET_RATIO}x",
            "value": value,
            "met": None if value is None else bool(value["median"] <= TARGET_RATIO),
        }
    ]


# --- output -----------------------------------------------------------------------------------------------------------


def _fmt(v: dict[str, Any] | None, f: str = ".0f", scale: float = 1.0) -> str:
    if v is None:
        return "-"
    return f"{scale * v['median']:{f}} [{scale * v['min']:{f}} - {scale * v['max']:{f}}]"


def write_outputs(data: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_balance.json").write_text(json.dumps(data, indent=2))
    s, cal = data["summary"], data["calibration"]
    hidden = "-".join(str(h) for h in data["hidden"])
    limit = f", {data['limit_train_batches']} batches per epoch" if data["limit_train_batches"] else ""
    lines = [
        f"2 CPU processes (gloo, 1 thread each) under ds_mirrored, DigitsClassifier 64-{hidden}-10 (SGD lr {LR}"
        f" momentum 0.9), global batch {data['global_batch_size']}, {data['warmup_epochs']} warm-up +"
        f" {data['epochs']} timed epoch(s){limit}, {data['repeats']} interleaved repeat(s)."
        f" Balancer: interval {data['interval']}, ema 0.5,"
        f" hysteresis 0.05. Straggler: rank {SLOW_RANK} sleeps {cal['delay_ms_per_sample']:.3f} ms per sample of its"
        " share in `training_step`"
        + (
            f" (slowdown {data['slowdown']:g} - 1 = {data['slowdown'] - 1:g} x the un-delayed compute of"
            f" {cal['undelayed_compute_ms_per_sample']:.3f} ms/sample in the calibration run: batch start to the launch"
            " of the last gradient bucket, / 32, median over steps, the smaller of the two ranks'). The sleep is"
            " fixed for the whole benchmark, so when the machine's load changes, rank 1's real slowdown per sample"
            " moves away from the nominal one: the 'rank 1 / rank 0 per sample' column gives the measured ratio."
            if "undelayed_compute_ms_per_sample" in cal
            else "."
        ),
        "Epoch time: rank 0, epoch start to the end of its last batch, median over the timed epochs of a run; then"
        " median [min - max] over repeats. Ratios and differences are taken per repeat. Compute per sample: batch start"
        " to the launch of the last gradient bucket (what the balancer measures), / local batch size; at unequal shares"
        " their ratio also carries the fixed cost per step, spread over fewer samples on the smaller share.",
        "",
        "| configuration | epoch (s) | first epoch (s) | median step, rank 0 (ms) | compute/sample rank 0 / rank 1"
        " (ms) | rank 1 / rank 0 per sample | final rank-0 share | final sizes | final val acc (%) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in (EQUAL, BALANCED):
        v = s[name]
        failed = f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""
        sizes = ", ".join(str(x) for x in v["final_sizes"]) or "-"
        lines.append(
            f"| {LABELS[name]}{failed} | {_fmt(v['epoch_s'], '.3f')} | {_fmt(v['first_epoch_s'], '.3f')}"
            f" | {_fmt(v['step_ms'], '.1f')} | {_fmt(v['compute_ms_per_sample_r0'], '.3f')}"
            f" / {_fmt(v['compute_ms_per_sample_r1'], '.3f')} | {_fmt(v['slow_over_fast_per_sample'], '.2f')}"
            f" | {_fmt(v['final_share_rank0'], '.3f')} | {sizes} | {_fmt(v['final_acc'], '.1f', 100)} |"
        )
    if "undelayed_median_epoch_s" in cal:
        lines += [
            "",
            f"Calibration run (equal split, no sleep): epoch {cal['undelayed_median_epoch_s']:.3f} s, median step"
            f" {cal['undelayed_median_step_ms']:.1f} ms, compute/sample rank 0 / rank 1"
            f" {' / '.join(f'{x:.3f}' for x in cal['undelayed_compute_ms_per_sample_ranks'])} ms (the smaller sizes"
            " the sleep).",
        ]
    lines += [
        "",
        "| balanced / equal, per repeat | median [min - max] |",
        "|---|---|",
        f"| epoch time | {_fmt(s['ratio_epoch'], '.3f')} |",
        f"| median step time, rank 0 | {_fmt(s['ratio_step'], '.3f')} |",
        f"| final val acc (points) | {_fmt(s['acc_points'], '+.1f')} |",
        "",
        "**Targets** (judged on the median)",
        "",
        "| target | goal | measured | result |",
        "|---|---|---|---|",
    ]
    for t in data["targets"]:
        result = {True: "PASS", False: "**MISS**", None: "no data"}[t["met"]]
        lines.append(f"| {t['target']} | {t['goal']} | {_fmt(t['value'], '.3f')} | {result} |")
    (out / "load_balance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(data, out / "load_balance.png")


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True)
    steps_per_epoch = 0
    for name in (EQUAL, BALANCED):
        runs = [r for r in data["raw"][name] if "error" not in r]
        for i, run in enumerate(runs):
            label = LABELS[name] if i == 0 else None
            shares = [sizes[0] / sum(sizes) for sizes in run["sizes"]]
            ax1.plot(range(len(shares)), shares, color=COLORS[name], alpha=0.8, lw=1.2, drawstyle="steps-post")
            ax2.plot(range(len(run["step_ms"])), run["step_ms"], color=COLORS[name], alpha=0.6, lw=0.9, label=label)
            steps_per_epoch = len(run["step_ms"]) // max(1, len(run["epoch_s"]))
    ax1.axhline(2 / 3, color="k", ls=":", lw=1, label="ideal rank-0 share (2/3)")
    for name in (EQUAL, BALANCED):
        ax1.plot([], [], color=COLORS[name], label=LABELS[name])
    for ax in (ax1, ax2):
        for e in range(1, data["warmup_epochs"] + data["epochs"]):
            if steps_per_epoch:
                ax.axvline(e * steps_per_epoch, color="k", alpha=0.15, lw=0.8)
        ax.grid(alpha=0.3)
    timed = [t for n in (EQUAL, BALANCED) for r in data["raw"][n] if "error" not in r for t in r["step_ms"][1:]]
    if timed:  # the first step (allocation, DDP set-up) is many times longer than the rest
        ax2.set_ylim(0, 3 * statistics.median(timed))
    if steps_per_epoch and data["warmup_epochs"]:
        for ax in (ax1, ax2):
            ax.axvspan(0, data["warmup_epochs"] * steps_per_epoch, color="k", alpha=0.05, lw=0)
    ax1.set_ylabel("rank 0's share of the global batch")
    ax1.set_ylim(0.4, 0.9)
    ax1.legend(fontsize=8, loc="lower right")
    ratio = data["summary"]["ratio_epoch"]
    title = f"rank {SLOW_RANK} {data['slowdown']:g}x slower per sample, global batch {data['global_batch_size']}"
    if ratio:
        title += f"; epoch time balanced / equal {ratio['median']:.3f} (target <= {TARGET_RATIO})"
    ax1.set_title(f"{title}\nevery repeat; lines: epoch boundaries; shaded: warm-up (not timed)", fontsize=10)
    ax2.set_ylabel("step time, rank 0 (ms; first step off the chart)")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 1 + 1 epochs of 10 batches: a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; 1 with --quick)")
    parser.add_argument("--epochs", type=int, default=None, help="timed epochs per run (10; 1 with --quick)")
    parser.add_argument("--warmup-epochs", type=int, default=3, help="epochs left out of the timing (3)")
    parser.add_argument(
        "--global-batch", type=int, default=DEFAULT_GLOBAL_BATCH, help=f"samples per step ({DEFAULT_GLOBAL_BATCH})"
    )
    parser.add_argument(
        "--limit-train-batches", type=int, default=None, help="batches per epoch (default all 23; 10 with --quick)"
    )
    parser.add_argument("--interval", type=int, default=3, help="the balanced run's re-division interval (3)")
    parser.add_argument("--slowdown", type=float, default=2.0, help="how much slower rank 1 is per sample (2)")
    parser.add_argument(
        "--delay-ms-per-sample",
        type=float,
        default=None,
        help="rank 1's sleep per sample (default: from a calibration run without sleep and --slowdown)",
    )
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024], help="hidden widths (1024 1024)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take before it is killed")
    parser.add_argument("--dist-timeout", type=int, default=120, help="seconds any collective may wait")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/results; a temp folder with --quick)"
    )
    opts = parser.parse_args()
    defaults = (
        {"repeats": 1, "epochs": 1, "limit_train_batches": 10}
        if opts.quick
        else {"repeats": 3, "epochs": 10, "limit_train_batches": None}
    )
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    if opts.out is None:  # a smoke test never overwrites the real results
        opts.out = Path(tempfile.mkdtemp(prefix="ds-balance-quick-")) if opts.quick else RESULTS
    start = time.monotonic()
    package_at_start = package_state()
    ran = run_all(opts)
    summary = summarise(ran["raw"])
    data = {
        "package": package_at_start,
        "repeats": opts.repeats,
        "epochs": opts.epochs,
        "warmup_epochs": opts.warmup_epochs,
        "limit_train_batches": opts.limit_train_batches,
        "interval": opts.interval,
        "global_batch_size": opts.global_batch,
        "hidden": opts.hidden,
        "workers": WORKERS,
        "slowdown": opts.slowdown,
        "calibration": ran["calibration"],
        "summary": summary,
        "targets": verdicts(summary),
        "seconds": time.monotonic() - start,
        "raw": ran["raw"],
    }
    if package_state() != package_at_start:  # every launch imports the package afresh: say so if it changed
        data["package_at_end"] = package_state()
        print("  note: the package changed while the benchmark ran (see package / package_at_end)", flush=True)
    write_outputs(data, opts.out)
    print(f"wrote {opts.out}/load_balance.{{json,md,png}} in {data['seconds'] / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
