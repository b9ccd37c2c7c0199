"""How fast is ds_mirrored? Against Lightning's ddp and a plain torch DDP loop, and per gradient_compression setting.

Runs every configuration on 2 CPU processes (gloo, 1 thread each) with the 64-1024-1024-10 MLP on the digits,
interleaving the configurations round by round (the machine is noisy), and reports medians, ratios and spreads.
Writes ``results/mirrored.json``, ``results/mirrored.png`` and ``results/mirrored.md``.

    python benchmarks/mirrored.py [--rounds 5] [--steps 150]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORKER = HERE / "_mirrored_worker.py"

STRATEGIES = {
    "ds_mirrored": ["--mode", "lightning", "--strategy", "ds_mirrored"],
    "lightning_ddp": ["--mode", "lightning", "--strategy", "ddp"],
    "plain_ddp": ["--mode", "plain"],
}
COMPRESSIONS = ["none", "fp16", "bf16", "powersgd"]
LINKS_MBIT = {"1 Gbit/s": 1000.0, "100 Mbit/s": 100.0}


def run_once(args: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.pop("MASTER_PORT", None)
        cmd = [sys.executable, str(WORKER), *args, "--steps", str(steps), "--out", str(out)]
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
        if not out.exists():
            raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
        # Training finished and reported; a crash while the interpreter exits is recorded, not fatal.
        result["exit_code"] = proc.returncode
        if proc.returncode != 0:
            print(f"  note: {' '.join(args)} exited with {proc.returncode} after writing its results", flush=True)
        return result


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def interleaved(configs: dict[str, list[str]], rounds: int, steps: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate, so no config always runs first
        for name in order:
            result = run_once(configs[name], steps)
            results[name].append(result)
            print(f"  round {r + 1}/{rounds} {name:>14}: {result['median_step_ms']:.2f} ms/step", flush=True)
    return results


def compare_strategies(rounds: int, steps: int) -> dict:
    print("strategies (interleaved):", flush=True)
    raw = interleaved(STRATEGIES, rounds, steps)
    medians = {name: [r["median_step_ms"] for r in runs] for name, runs in raw.items()}
    ratio_ddp = [a / b for a, b in zip(medians["ds_mirrored"], medians["lightning_ddp"], strict=True)]
    ratio_plain = [a / b for a, b in zip(medians["ds_mirrored"], medians["plain_ddp"], strict=True)]
    return {
        "exit_codes": {name: [r["exit_code"] for r in runs] for name, runs in raw.items()},
        "step_ms": {name: spread(values) for name, values in medians.items()},
        "ratio_ds_mirrored_over_lightning_ddp": spread(ratio_ddp),
        "ratio_ds_mirrored_over_plain_ddp": spread(ratio_plain),
    }


def compare_compression(rounds: int, steps: int) -> dict:
    print("gradient_compression (interleaved):", flush=True)
    configs = {c: ["--mode", "lightning", "--strategy", "ds_mirrored", "--compression", c] for c in COMPRESSIONS}
    raw = interleaved(configs, rounds, steps)
    out = {}
    for name, runs in raw.items():
        step = statistics.median(r["median_step_ms"] for r in runs)
        sent = statistics.median(r["comm_bytes_per_step"] for r in runs)
        # Projection, not a measurement: loopback time plus the payload at the link rate (2-rank ring all-reduce sends
        # about the payload once per rank). Measured on shaped links by the cluster benchmark.
        projected = {link: step + sent * 8 / (mbit * 1e6) * 1000 for link, mbit in LINKS_MBIT.items()}
        out[name] = {
            "step_ms": spread([r["median_step_ms"] for r in runs]),
            "bytes_per_step": sent,
            "uncompressed_bytes_per_step": runs[0]["uncompressed_bytes_per_step"],
            "projected_step_ms": projected,
        }
    return out


def write_outputs(data: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mirrored.json").write_text(json.dumps(data, indent=2))
    s, c = data["strategies"], data["compression"]
    lines = [
        f"2 CPU processes (gloo, 1 thread each), MLP 64-1024-1024-10, batch 32 per process, {data['steps']} timed steps"
        f" per run, {data['rounds']} interleaved rounds. Median of per-run medians [min - max].",
        "",
        "| strategy | step (ms) |",
        "|---|---|",
    ]
    for name, v in s["step_ms"].items():
        lines.append(f"| {name} | {v['median']:.2f} [{v['min']:.2f} - {v['max']:.2f}] |")
    for key, label in (
        ("ratio_ds_mirrored_over_lightning_ddp", "ds_mirrored / Lightning ddp (target <= 1.00)"),
        ("ratio_ds_mirrored_over_plain_ddp", "ds_mirrored / plain DDP loop (target <= 1.10)"),
    ):
        v = s[key]
        lines.append(f"| **{label}** | **{v['median']:.3f}** [{v['min']:.3f} - {v['max']:.3f}] |")
    lines += [
        "",
        "| gradient_compression | bytes/step | vs none | loopback step (ms) | projected @1 Gbit/s"
        " | projected @100 Mbit/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in c.items():
        p = v["projected_step_ms"]
        share = v["bytes_per_step"] / v["uncompressed_bytes_per_step"]
        lines.append(
            f"| {name} | {v['bytes_per_step'] / 1e6:.3f} MB | {share:.3f}x"
            f" | {v['step_ms']['median']:.2f} [{v['step_ms']['min']:.2f} - {v['step_ms']['max']:.2f}]"
            f" | {p['1 Gbit/s']:.1f} | {p['100 Mbit/s']:.1f} |"
        )
    (RESULTS / "mirrored.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(s["step_ms"])
    med = [s["step_ms"][n]["median"] for n in names]
    err = [
        [m - s["step_ms"][n]["min"] for n, m in zip(names, med, strict=True)],
        [s["step_ms"][n]["max"] - m for n, m in zip(names, med, strict=True)],
    ]
    ax1.bar(names, med, yerr=err, capsize=4, color=["tab:blue", "tab:orange", "tab:gray"])
    ax1.set_ylabel("median step time (ms)")
    ax1.set_title("2 CPU procs, MLP 64-1024-1024-10 (min-max over rounds)")
    comp = list(c)
    x = range(len(comp))
    ax2.bar([i - 0.2 for i in x], [c[k]["bytes_per_step"] / 1e6 for k in comp], width=0.4, label="MB sent / step")
    ax2.set_ylabel("MB per step per rank")
    ax2.set_xticks(list(x), comp)
    twin = ax2.twinx()
    twin.bar(
        [i + 0.2 for i in x],
        [c[k]["step_ms"]["median"] for k in comp],
        width=0.4,
        color="tab:orange",
        label="loopback ms",
    )
    twin.plot(
        list(x), [c[k]["projected_step_ms"]["100 Mbit/s"] for k in comp], "k^--", label="projected ms @100 Mbit/s"
    )
    twin.set_ylabel("step time (ms)")
    twin.set_yscale("log")
    ax2.set_title("ds_mirrored gradient_compression")
    handles = ax2.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax2.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "mirrored.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    data = {"rounds": args.rounds, "steps": args.steps}
    data["strategies"] = compare_strategies(args.rounds, args.steps)
    data["compression"] = compare_compression(max(3, args.rounds - 2), args.steps)
    write_outputs(data)


if __name__ == "__main__":
    main()
