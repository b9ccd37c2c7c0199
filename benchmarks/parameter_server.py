"""Does ds_parameter_server beat ds_mirrored when one worker straggles, and what does it cost when none does?

Trains the digits classifier (``DigitsClassifier``, 64-128-10, SGD lr 0.05 momentum 0.9, batch 32 per worker) on 2 CPU
workers (1 thread each), worker 1 made 3x slower by a per-sample sleep before each of its steps, under ds_mirrored and
ds_parameter_server (1 server) with max_staleness 0, 4 and None; every configuration processes the same number of
training samples. Reports samples/s, validation accuracy against samples seen, and the step time of max_staleness=0 vs
ds_mirrored with no straggler. Configurations run as separate launches, interleaved repeat by repeat (the machine is
noisy); the tables give medians, ratios to ds_mirrored and the min-max spread.

Method. The straggler's sleep per sample is (slowdown - 1) x the un-delayed ds_mirrored step / batch, measured by the
first run (ds_mirrored, no straggler); sleeping costs no CPU. Equal samples: ds_mirrored runs ``--steps`` steps per
worker; ds_parameter_server gets ``max_updates`` = ``--steps`` (max_staleness=0: one update takes a batch from every
worker) or ``2 x --steps`` (otherwise: one batch per update), so fast workers do more steps. A push already in flight
when the budget runs out is still applied (one batch more at most); the real totals are used. Samples/s: samples of
all workers / (last step end - first step start). Accuracy: rank 0 evaluates its current parameters (under
ds_parameter_server the last pulled ones) on the validation split every ``--eval-every`` steps with no collectives;
samples seen come from the servers' update count. The classifier's epoch-level ``train_acc`` is kept local
(``sync_on_compute=False``) under every strategy: its all-gather at each epoch end would re-synchronise
ds_parameter_server's workers once per epoch.

Writes ``parameter_server.json``, ``parameter_server.md`` and ``parameter_server.png`` to ``results/`` (or ``--out``;
``--quick`` writes to a temporary folder unless ``--out`` is given).

    python benchmarks/parameter_server.py [--quick] [--repeats 3] [--steps 150] [--eval-every 10] [--slowdown 3]
                                          [--delay-ms-per-sample MS] [--timeout 300] [--dist-timeout 120] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
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
WORKER = HERE / "_parameter_server_worker.py"

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

# Under the straggler.
STRAGGLER_CONFIGS: dict[str, dict[str, Any]] = {
    MIRRORED: {"strategy": "ds_mirrored"},
    BSP: {"strategy": "ds_parameter_server", "max_staleness": 0},
    "ps_staleness_4": {"strategy": "ds_parameter_server", "max_staleness": 4},
    ASYNC: {"strategy": "ds_parameter_server", "max_staleness": None},
}
NO_STRAGGLER_CONFIGS: dict[str, dict[str, Any]] = {
    MIRRORED: {"strategy": "ds_mirrored"},
    BSP: {"strategy": "ds_parameter_server", "max_staleness": 0},
}
LABELS = {
    MIRRORED: "ds_mirrored",
    BSP: "ds_parameter_server max_staleness=0",
    "ps_staleness_4": "ds_parameter_server max_staleness=4",
    ASYNC: "ds_parameter_server max_staleness=None",
}


# --- launching --------------------------------------------------------------------------------------------------------


def run_once(config: dict[str, Any], delay_per_sample: float, opts: argparse.Namespace) -> dict[str, Any]:
    """One launch (2 workers, and 1 server under ds_parameter_server); the workers' records merged, or an error."""
    with tempfile.TemporaryDirectory(prefix="ds-ps-bench-") as tmp:
        records = Path(tmp) / "records"
        records.mkdir()
        spec = {
            "max_staleness": None,
            **config,
            "batch_size": BATCH,
            "steps": opts.steps,
            "seed": 0,
            "dist_timeout": opts.dist_timeout,
            "slow_rank": SLOW_RANK,
            "delay_per_sample": delay_per_sample,
            "eval_every": opts.eval_every,
            "hidden": [128],
            "lr": 0.05,
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
        return merge(ranks, rc, seconds)


def merge(ranks: dict[int, dict[str, Any]], rc: Any, seconds: float) -> dict[str, Any]:
    """Throughput over the training phase of all workers together; step times per worker; rank 0's curve."""
    samples = sum(r["samples"] for r in ranks.values())
    wall = max(r["last_end"] for r in ranks.values()) - min(r["first_start"] for r in ranks.values())
    fast, slow = ranks[0], ranks[SLOW_RANK]
    return {
        "exit_code": rc,
        "launch_s": seconds,
        "samples": samples,
        "train_s": wall,
        "samples_per_s": samples / wall,
        "steps": [ranks[r]["steps"] for r in sorted(ranks)],
        "step_ms": [ranks[r]["median_step_ms"] for r in sorted(ranks)],
        "busy_ms": [ranks[r]["median_busy_ms"] for r in sorted(ranks)],
        "phase_ms": [ranks[r]["phase_ms"] for r in sorted(ranks)],
        "slow_over_fast_step": slow["median_step_ms"] / fast["median_step_ms"],
        "curve": fast["curve"],
        "final_acc": fast["final_acc"],
        "final_samples_seen": samples,  # the final parameters have seen every worker's pushes
        "eval_s": fast["eval_s"],
    }


def rotated(names: list[str], r: int) -> list[str]:
    return names[r % len(names) :] + names[: r % len(names)]  # no configuration always runs first


def run_all(opts: argparse.Namespace) -> dict[str, Any]:
    straggler = STRAGGLER_CONFIGS
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        "straggler": {k: [] for k in straggler},
        "no_straggler": {k: [] for k in NO_STRAGGLER_CONFIGS},
    }
    delay = None if opts.delay_ms_per_sample is None else opts.delay_ms_per_sample / 1000
    calibration: dict[str, Any] = {"source": "--delay-ms-per-sample"} if delay is not None else {}
    for r in range(opts.repeats):
        # The no-straggler pair first: in the first repeat its ds_mirrored run calibrates the straggler's delay.
        order = [("no_straggler", n) for n in rotated(list(NO_STRAGGLER_CONFIGS), r)]
        order += [("straggler", n) for n in rotated(list(straggler), r)]
        for group, name in order:
            if group == "straggler" and delay is None:
                raise RuntimeError("the calibration run (ds_mirrored without straggler) failed; see the errors above")
            configs = straggler if group == "straggler" else NO_STRAGGLER_CONFIGS
            result = run_once(configs[name], delay if group == "straggler" else 0.0, opts)
            raw[group][name].append(result)
            if "error" in result:
                print(f"  repeat {r + 1}/{opts.repeats} {group:>12} {name:>30}: FAILED {result['error']}", flush=True)
                continue
            print(
                f"  repeat {r + 1}/{opts.repeats} {group:>12} {name:>30}: {result['samples_per_s']:7.0f} samples/s,"
                f" steps {result['steps']}, median step {result['step_ms'][0]:.1f}/{result['step_ms'][1]:.1f} ms,"
                f" final acc {result['final_acc']:.4f} ({result['launch_s']:.0f} s launch)",
                flush=True,
            )
            if delay is None and group == "no_straggler" and name == MIRRORED:
                step_ms = result["step_ms"][0]
                delay = (opts.slowdown - 1) * step_ms / 1000 / BATCH
                calibration = {"source": "first ds_mirrored run without straggler", "undelayed_step_ms": step_ms}
                print(
                    f"  straggler: worker {SLOW_RANK} sleeps {1000 * delay:.3f} ms/sample ="
                    f" {1000 * delay * BATCH:.1f} ms per step of {BATCH} ({opts.slowdown:g}x the {step_ms:.1f} ms"
                    " un-delayed ds_mirrored step)",
                    flush=True,
                )
    assert delay is not None
    calibration.update(delay_ms_per_sample=1000 * delay, delay_ms_per_step=1000 * delay * BATCH)
    return {"raw": raw, "calibration": calibration}


# --- statistics -------------------------------------------------------------------------------------------------------


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str, op: Any) -> dict[str, Any] | None:
    """``op(a_r, b_r)`` per repeat r where both runs succeeded."""
    return spread([op(x[key], y[key]) for x, y in zip(a, b, strict=True) if "error" not in x and "error" not in y])


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = runs.get(MIRRORED, [])
    out = {}
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        entry: dict[str, Any] = {
            "failed_runs": len(results) - len(ok),
            "errors": [r["error"] for r in results if "error" in r],
            "samples_per_s": spread([r["samples_per_s"] for r in ok]),
            "samples": spread([r["samples"] for r in ok]),
            "final_acc": spread([r["final_acc"] for r in ok]),
            "step_ms_w0": spread([r["step_ms"][0] for r in ok]),
            "step_ms_w1": spread([r["step_ms"][1] for r in ok]),
            "busy_ms_w1": spread([r["busy_ms"][1] for r in ok]),
            "steps_w0": spread([r["steps"][0] for r in ok]),
            "steps_w1": spread([r["steps"][1] for r in ok]),
            "slow_over_fast_step": spread([r["slow_over_fast_step"] for r in ok]),
            "phase_ms": [
                {phase: spread([r["phase_ms"][w][phase] for r in ok]) for phase in PHASES} for w in range(WORKERS)
            ],
        }
        if name != MIRRORED and base:
            entry["throughput_over_mirrored"] = paired(results, base, "samples_per_s", lambda x, y: x / y)
            entry["acc_points_vs_mirrored"] = paired(results, base, "final_acc", lambda x, y: 100 * (x - y))
            entry["step_over_mirrored"] = paired(results, base, "step_ms", lambda x, y: x[0] / y[0])
        out[name] = entry
    return out


def verdicts(s: dict[str, Any], n: dict[str, Any]) -> list[dict[str, Any]]:
    def check(label: str, value: dict[str, Any] | None, ok: Any, goal: str) -> dict[str, Any]:
        met = None if value is None else bool(ok(value["median"]))
        return {"target": label, "goal": goal, "value": value, "met": met}

    out = [
        check(
            "async throughput vs ds_mirrored under the straggler",
            s.get(ASYNC, {}).get("throughput_over_mirrored"),
            lambda v: v >= TARGET_ASYNC_SPEEDUP,
            f">= {TARGET_ASYNC_SPEEDUP}x",
        )
    ]
    for name in (ASYNC, "ps_staleness_4", BSP):
        if name in s:
            out.append(
                check(
                    f"final accuracy of {LABELS[name]} vs ds_mirrored at equal samples",
                    s[name].get("acc_points_vs_mirrored"),
                    lambda v: v >= -TARGET_ACC_POINTS,
                    f"at most {TARGET_ACC_POINTS:g} points below",
                )
            )
    out.append(
        check(
            "max_staleness=0 step time vs ds_mirrored, no straggler",
            n.get(BSP, {}).get("step_over_mirrored"),
            lambda v: v <= TARGET_BSP_STEP,
            f"<= {TARGET_BSP_STEP}x",
        )
    )
    return out


# --- output -----------------------------------------------------------------------------------------------------------


def _fmt(v: dict[str, Any] | None, f: str = ".0f", scale: float = 1.0) -> str:
    if v is None:
        return "-"
    return f"{scale * v['median']:{f}} [{scale * v['min']:{f}} - {scale * v['max']:{f}}]"


def write_outputs(data: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "parameter_server.json").write_text(json.dumps(data, indent=2))
    s, n, cal = data["straggler"], data["no_straggler"], data["calibration"]
    lines = [
        f"2 CPU workers (gloo, 1 thread each; ds_parameter_server adds 1 server process), DigitsClassifier 64-128-10,"
        f" batch {BATCH} per worker, {data['steps']} ds_mirrored steps per worker = {WORKERS * data['steps'] * BATCH}"
        f" training samples per run under every configuration, {data['repeats']} interleaved repeat(s)."
        f" Straggler: worker {SLOW_RANK} sleeps {cal['delay_ms_per_sample']:.3f} ms/sample"
        f" ({cal['delay_ms_per_step']:.1f} ms per step) before each step"
        + (
            f", {data['slowdown']:g}x the un-delayed ds_mirrored step of {cal['undelayed_step_ms']:.1f} ms."
            if "undelayed_step_ms" in cal
            else "."
        ),
        "Median [min - max] over repeats; ratios and differences are taken per repeat against that repeat's"
        " ds_mirrored run. Samples/s: samples pushed by all workers / (last step end - first step start).",
        "",
        "**With the straggler**",
        "",
        "| configuration | samples/s | vs ds_mirrored | final val acc | acc vs ds_mirrored (points) | samples"
        " | steps w0 / w1 | median step w0 / w1 (ms) | w1 / w0 step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in s.items():
        failed = f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""
        lines.append(
            f"| {LABELS[name]}{failed} | {_fmt(v['samples_per_s'])} | {_fmt(v.get('throughput_over_mirrored'), '.2f')}"
            f" | {_fmt(v['final_acc'], '.1f', 100)} | {_fmt(v.get('acc_points_vs_mirrored'), '+.1f')}"
            f" | {_fmt(v['samples'])} | {_fmt(v['steps_w0'])} / {_fmt(v['steps_w1'])}"
            f" | {_fmt(v['step_ms_w0'], '.1f')} / {_fmt(v['step_ms_w1'], '.1f')}"
            f" | {_fmt(v['slow_over_fast_step'], '.2f')} |"
        )
    lines += [
        "",
        "**Without a straggler**",
        "",
        "| configuration | median step w0 (ms) | vs ds_mirrored |",
        "|---|---|---|",
    ]
    for name, v in n.items():
        failed = f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""
        lines.append(
            f"| {LABELS[name]}{failed} | {_fmt(v['step_ms_w0'], '.1f')} | {_fmt(v.get('step_over_mirrored'), '.2f')} |"
        )
    lines += [
        "",
        "**Where each worker's step goes** (median ms): the straggler's sleep; up to `training_step` (the pull under"
        " ds_parameter_server, a BSP pull waits for the other worker); `training_step` + backward (under ds_mirrored"
        " including the gradient all-reduce, which waits for the other worker); after backward (the push under"
        " ds_parameter_server, the optimizer step under ds_mirrored).",
        "",
        "| run | configuration | worker | sleep | before training_step | training_step + backward | after backward"
        " | whole step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for group, summary in (("straggler", s), ("no straggler", n)):
        for name, v in summary.items():
            for w in range(WORKERS):
                cells = " | ".join(_fmt(v["phase_ms"][w][p], ".1f") for p in PHASES)
                lines.append(f"| {group} | {LABELS[name]} | {w} | {cells} | {_fmt(v[f'step_ms_w{w}'], '.1f')} |")
    lines += [
        "",
        "**Targets** (judged on the median)",
        "",
        "| target | goal | measured | result |",
        "|---|---|---|---|",
    ]
    for t in data["targets"]:
        result = {True: "PASS", False: "**MISS**", None: "no data"}[t["met"]]
        fmt = ".2f" if "points" not in t["goal"] else "+.1f"
        lines.append(f"| {t['target']} | {t['goal']} | {_fmt(t['value'], fmt)} | {result} |")
    (out / "parameter_server.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(data, out / "parameter_server.png")


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, n = data["straggler"], data["no_straggler"]
    colors = dict(zip(LABELS, ["tab:blue", "tab:orange", "tab:green", "tab:red"], strict=True))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [2.2, 1.4, 0.8]})
    for name, runs in data["raw"]["straggler"].items():
        for i, run in enumerate(r for r in runs if "error" not in r):
            xs, ys = zip(*run["curve"], strict=True)
            style = "--" if name == BSP else "-"  # ds_mirrored's numerics: the two curves coincide
            ax1.plot(
                xs, [100 * y for y in ys], style, color=colors[name], alpha=0.75, lw=1.2, label=None if i else name
            )
            ax1.plot(run["final_samples_seen"], 100 * run["final_acc"], "o", color=colors[name], ms=4)
    ax1.set_xlabel("training samples seen (all workers)")
    ax1.set_ylabel("validation accuracy (%), rank 0's parameters")
    ax1.set_ylim(50, 100)
    ax1.set_title(f"with a {data['slowdown']:g}x straggler: accuracy vs samples (every repeat; dot = final)")
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
        ratio = s[k].get("throughput_over_mirrored")
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
        ratio = n[k].get("step_over_mirrored")
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


# --- main -------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 30 steps: a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; 1 with --quick)")
    parser.add_argument(
        "--steps", type=int, default=None, help="ds_mirrored steps per worker, which sets every run's samples (150)"
    )
    parser.add_argument("--eval-every", type=int, default=None, help="rank 0 evaluates every this many steps (10)")
    parser.add_argument(
        "--delay-ms-per-sample",
        type=float,
        default=None,
        help="the straggler's sleep per sample (default: from the first un-delayed ds_mirrored run and --slowdown)",
    )
    parser.add_argument("--slowdown", type=float, default=3.0, help="how much slower the straggler's step is (3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take before it is killed")
    parser.add_argument("--dist-timeout", type=int, default=120, help="seconds any collective or server reply may wait")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/results; a temp folder with --quick)"
    )
    opts = parser.parse_args()
    defaults = (
        {"repeats": 1, "steps": 30, "eval_every": 5} if opts.quick else {"repeats": 3, "steps": 150, "eval_every": 10}
    )
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    if opts.out is None:  # a smoke test never overwrites the real results
        opts.out = Path(tempfile.mkdtemp(prefix="ds-ps-quick-")) if opts.quick else RESULTS
    start = time.monotonic()
    package_at_start = package_state()
    ran = run_all(opts)
    straggler = summarise(ran["raw"]["straggler"])
    no_straggler = summarise(ran["raw"]["no_straggler"])
    data = {
        "package": package_at_start,
        "repeats": opts.repeats,
        "steps": opts.steps,
        "batch_size": BATCH,
        "workers": WORKERS,
        "slowdown": opts.slowdown,
        "calibration": ran["calibration"],
        "straggler": straggler,
        "no_straggler": no_straggler,
        "targets": verdicts(straggler, no_straggler),
        "seconds": time.monotonic() - start,
        "raw": ran["raw"],
    }
    if package_state() != package_at_start:  # every launch imports the package afresh: say so if it changed
        data["package_at_end"] = package_state()
        print("  note: the package changed while the benchmark ran (see package / package_at_end)", flush=True)
    write_outputs(data, opts.out)
    print(f"wrote {opts.out}/parameter_server.{{json,md,png}} in {data['seconds'] / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
