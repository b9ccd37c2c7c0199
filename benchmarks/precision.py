"""What do step time and peak memory do under MixedPrecision("bf16") (and "fp16") against fp32, on the same model?

Trains the digits classifier (``DigitsClassifier``, 64-1024-1024-10 by default, SGD lr 0.05 momentum 0.9, batch 256)
in one process (1 thread on CPU; the GPU when CUDA is available, unless ``--accelerator cpu``), once per
configuration: *fp32* (no callback), *bf16* (``MixedPrecision("bf16")``: bf16 autocast, fp32 parameters and
optimizer) and *fp16* (``MixedPrecision("fp16")``: fp16 autocast with a ``GradScaler``). There is no numeric target: the
figures are reported as measured.

Method. Every run is a fresh process (so its peak RSS is its own), the configurations alternate run by run and repeat
``--repeats`` times (the machine is noisy). Step time: batch start to batch end (forward, backward, optimizer step;
data loading excluded), median over the steps after ``--warmup`` warm-up steps. Peak memory: on CPU, how much the
process's peak resident set size (``ru_maxrss``) grew during ``fit``, a high-water mark of the whole process that
includes allocator caching and Lightning's own allocations; on CUDA, ``torch.cuda.max_memory_allocated()`` during
``fit``. Saved for backward: the bytes autograd keeps for backward in one step (each storage once, parameters
excluded, counted with saved-tensor hooks), split into activations, the part of memory mixed precision is meant to
halve, and autocast's low-precision copies of the weights, which it adds. Ratios are taken per repeat against that
repeat's fp32 run.

Writes ``precision.json``, ``precision.md`` and ``precision.png`` to ``results/`` (or ``--out``; ``--quick`` writes
to a temporary folder unless ``--out`` is given).

    python benchmarks/precision.py [--quick] [--repeats 3] [--steps 20] [--warmup 3] [--batch-size 256]
                                   [--hidden 1024 1024] [--configs fp32 bf16 fp16] [--accelerator auto|cpu|cuda]
                                   [--timeout 900] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
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
WORKER = HERE / "_precision_worker.py"

LR = 0.05
BASE = "fp32"
CONFIGS = ("fp32", "bf16", "fp16")
LABELS = {"fp32": "fp32 (no callback)", "bf16": 'MixedPrecision("bf16")', "fp16": 'MixedPrecision("fp16")'}
COLORS = {"fp32": "tab:gray", "bf16": "tab:blue", "fp16": "tab:orange"}
MB = 1024**2


# --- launching --------------------------------------------------------------------------------------------------------


def run_once(precision: str, opts: argparse.Namespace) -> dict[str, Any]:
    """One run in a fresh process; its figures, or an error."""
    with tempfile.TemporaryDirectory(prefix="ds-precision-bench-") as tmp:
        out = Path(tmp) / "result.json"
        spec = {
            "precision": precision,
            "accelerator": opts.accelerator,
            "threads": opts.threads,
            "batch_size": opts.batch_size,
            "hidden": opts.hidden,
            "lr": LR,
            "warmup": opts.warmup,
            "steps": opts.steps,
            "out": str(out),
        }
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = Path(tmp) / "log.txt"
        start = time.monotonic()
        env = worker_env(opts.threads, rendezvous=False)
        rc: Any = run_detached(WORKER, spec_path, tmp, log_path, opts.timeout, env)
        seconds = time.monotonic() - start
        tail = log_path.read_text(errors="replace")[-3000:]
        if not out.exists() or rc == "timeout":
            reason = f"timed out after {opts.timeout:.0f} s" if rc == "timeout" else f"exit code {rc}"
            errors = [line.strip() for line in tail.splitlines() if "Error" in line or "error" in line]
            if errors:
                reason += f", {errors[-1][:300]}"
            return {"error": reason, "log_tail": tail[-1500:], "launch_s": seconds}
        result = json.loads(out.read_text())
    timed = result["step_ms"][opts.warmup :] or result["step_ms"]
    result.update(
        exit_code=rc,
        launch_s=seconds,
        median_step_ms=statistics.median(timed),
        peak_mb=(
            result["cuda_peak_allocated_bytes"]
            if "cuda_peak_allocated_bytes" in result
            else result["peak_rss_delta_bytes"]
        )
        / MB,
        activation_mb=max(result["activation_bytes"]) / MB,
        weight_copy_mb=max(result["weight_copy_bytes"]) / MB,
        final_loss=result["loss"][-1],
    )
    return result


def run_all(opts: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in opts.configs}
    names = list(opts.configs)
    for r in range(opts.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # no configuration always runs first
            result = run_once(name, opts)
            raw[name].append(result)
            if "error" in result:
                print(f"  repeat {r + 1}/{opts.repeats} {name:>5}: FAILED {result['error']}", flush=True)
                continue
            print(
                f"  repeat {r + 1}/{opts.repeats} {name:>5}: median step {result['median_step_ms']:.1f} ms,"
                f" peak memory {result['peak_mb']:.1f} MB, saved for backward {result['activation_mb']:.2f} MB"
                f" activations + {result['weight_copy_mb']:.2f} MB weight copies,"
                f" final loss {result['final_loss']:.3f} ({result['launch_s']:.0f} s launch)",
                flush=True,
            )
    return raw


# --- statistics -------------------------------------------------------------------------------------------------------


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """``a_r[key] / b_r[key]`` per repeat r where both runs succeeded (and the divisor is not 0)."""
    return spread(
        [x[key] / y[key] for x, y in zip(a, b, strict=True) if "error" not in x and "error" not in y and y[key] > 0]
    )


def summarise(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = raw.get(BASE, [])
    out = {}
    for name, results in raw.items():
        ok = [r for r in results if "error" not in r]
        entry: dict[str, Any] = {
            "failed_runs": len(results) - len(ok),
            "errors": [r["error"] for r in results if "error" in r],
            "chosen": sorted({r["chosen"] for r in ok}),
            "step_ms": spread([r["median_step_ms"] for r in ok]),
            "peak_mb": spread([r["peak_mb"] for r in ok]),
            "peak_rss_after_mb": spread([r["peak_rss_after_bytes"] / MB for r in ok]),
            "activation_mb": spread([r["activation_mb"] for r in ok]),
            "weight_copy_mb": spread([r["weight_copy_mb"] for r in ok]),
            "saved_mb": spread([r["activation_mb"] + r["weight_copy_mb"] for r in ok]),
            "final_loss": spread([r["final_loss"] for r in ok]),
        }
        if name != BASE and base:
            entry["time_over_fp32"] = paired(results, base, "median_step_ms")
            entry["peak_over_fp32"] = paired(results, base, "peak_mb")
            entry["activation_over_fp32"] = paired(results, base, "activation_mb")
        out[name] = entry
    return out


def cpu_info() -> dict[str, Any]:
    """The CPU's name and whether it has native bf16 / fp16 matrix instructions (Linux; empty elsewhere)."""
    info: dict[str, Any] = {"machine": platform.machine(), "cores": os.cpu_count()}
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
                break
        flags = set()
        for line in text.splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
        wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")
        info["flags"] = [f for f in wanted if f in flags]
    return info


# --- output -----------------------------------------------------------------------------------------------------------


def _fmt(v: dict[str, Any] | None, f: str = ".1f", scale: float = 1.0) -> str:
    if v is None:
        return "-"
    return f"{scale * v['median']:{f}} [{scale * v['min']:{f}} - {scale * v['max']:{f}}]"


def findings(data: dict[str, Any]) -> list[str]:
    """Plain-language reading of the medians (no targets: the issue sets none)."""
    s, out = data["summary"], []
    cpu = data["accelerator_used"] == "cpu"
    flags = data["cpu"].get("flags", [])
    native = [f for f in flags if "bf16" in f or "fp16" in f]
    for name in (n for n in s if n != BASE):
        t, m, a = s[name].get("time_over_fp32"), s[name].get("peak_over_fp32"), s[name].get("activation_over_fp32")
        if t is None:
            continue
        speed = (
            f"{t['median']:.2f}x the fp32 step time, i.e. {t['median']:.1f} times slower"
            if t["median"] >= 1
            else f"{t['median']:.2f}x the fp32 step time, a {1 / t['median']:.2f}x speed-up"
        )
        line = f"- {LABELS[name]}: {speed}"
        if m is not None:
            line += f"; peak memory {m['median']:.2f}x fp32's"
        if a is not None:
            copies = s[name]["weight_copy_mb"]["median"] if s[name]["weight_copy_mb"] else 0.0
            total = s[name]["saved_mb"]["median"] / s[BASE]["saved_mb"]["median"] if s[BASE]["saved_mb"] else None
            line += f"; activations saved for backward {a['median']:.2f}x fp32's"
            if copies > 0:
                line += (
                    f", but autocast also keeps {copies:.2f} MB of low-precision weight copies for backward, which"
                    " fp32 does not need"
                )
            if total is not None:
                line += f" (all saved for backward: {total:.2f}x fp32's)"
        out.append(line + ".")
        if cpu and t["median"] > 1:
            why = (
                f"this CPU has no native bf16/fp16 matrix instructions (flags found: {', '.join(flags) or 'none'}),"
                " so the low-precision matrix multiplications run without hardware support (most likely the main"
                " cost), and the casts add to it"
                if not native
                else f"even with {', '.join(native)}, the kernels used here and the casts cost more than fp32's"
            )
            out.append(
                f"  {LABELS[name]} is slower than fp32 on this CPU: {why}. This is a valid finding, not a failure of"
                " the callback: on such a CPU, mixed precision can only buy activation memory, and only where"
                " activations outweigh the weight copies (large batches relative to the layer widths)."
            )
    if cpu:
        out.append(
            "- Peak RSS is a coarse measure: a high-water mark of the whole process, it includes allocator caching,"
            " Lightning's own allocations and autocast's weight copies, so differences of a few MB in it are not"
            " significant; the saved-for-backward columns count what mixed precision changes directly."
        )
    return out


def write_outputs(data: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.json").write_text(json.dumps(data, indent=2))
    s = data["summary"]
    hidden = "-".join(str(h) for h in data["hidden"])
    cpu = data["cpu"]
    if data["accelerator_used"] == "cuda":
        device = f"CUDA ({data.get('cuda_device', 'GPU')})"
        memory = "peak `torch.cuda.max_memory_allocated()` during `fit` (parameters, gradients, optimizer state and"
        memory += " activations)"
    else:
        flags = ", ".join(cpu.get("flags", [])) or "none of note"
        device = f"CPU ({cpu.get('model', 'unknown')}, {data['threads']} torch thread(s); flags: {flags})"
        memory = (
            "growth of the process's peak resident set size (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) from just"
            " before `fit` to after it, in a fresh process per run"
        )
    lines = [
        f"One process on {device}, DigitsClassifier 64-{hidden}-10 (SGD lr {LR} momentum 0.9), batch"
        f" {data['batch_size']}, {data['warmup']} warm-up + {data['steps']} timed steps per run,"
        f" {data['repeats']} interleaved repeat(s), every run a fresh process.",
        "Step time: batch start to batch end (forward, backward, optimizer step), median over a run's timed steps."
        f" **Peak memory: {memory}.** Saved for backward: bytes autograd keeps for backward in one step (the largest"
        " step; each storage once; parameters excluded), split into activations and autocast's low-precision copies"
        " of the weights. Median [min - max] over repeats; ratios per repeat against that repeat's fp32 run. No"
        " target: the issue sets none.",
        "",
        "| configuration | step (ms) | vs fp32 | peak memory (MB) | vs fp32 | activations saved (MB) | vs fp32"
        " | weight copies saved (MB) | final train loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in s.items():
        failed = f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""
        lines.append(
            f"| {LABELS[name]}{failed} | {_fmt(v['step_ms'])} | {_fmt(v.get('time_over_fp32'), '.2f')}"
            f" | {_fmt(v['peak_mb'])} | {_fmt(v.get('peak_over_fp32'), '.2f')} | {_fmt(v['activation_mb'], '.2f')}"
            f" | {_fmt(v.get('activation_over_fp32'), '.2f')} | {_fmt(v['weight_copy_mb'], '.2f')}"
            f" | {_fmt(v['final_loss'], '.3f')} |"
        )
    lines += ["", "**Reading**", "", *findings(data)]
    (out / "precision.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(data, out / "precision.png")


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["summary"]
    names = [n for n in s if s[n]["step_ms"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    panels = (
        ("step_ms", "time_over_fp32", "median step time (ms)"),
        (
            "peak_mb",
            "peak_over_fp32",
            "peak memory (MB): " + ("CUDA allocated" if data["accelerator_used"] == "cuda" else "RSS growth over fit"),
        ),
    )
    for ax, (key, ratio_key, label) in zip(axes[:2], panels, strict=True):
        med = [s[n][key]["median"] for n in names]
        err = [
            [m - s[n][key]["min"] for n, m in zip(names, med, strict=True)],
            [s[n][key]["max"] - m for n, m in zip(names, med, strict=True)],
        ]
        ax.bar(range(len(names)), med, yerr=err, capsize=4, color=[COLORS[n] for n in names])
        for i, n in enumerate(names):
            ratio = s[n].get(ratio_key)
            if ratio:
                ax.annotate(f"{ratio['median']:.2f}x", (i, s[n][key]["max"]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    ax = axes[2]
    acts = [s[n]["activation_mb"]["median"] for n in names]
    copies = [s[n]["weight_copy_mb"]["median"] for n in names]
    ax.bar(range(len(names)), acts, color=[COLORS[n] for n in names], label="activations")
    ax.bar(range(len(names)), copies, bottom=acts, color="none", edgecolor="k", hatch="//", label="weight copies")
    for i, n in enumerate(names):
        ratio = s[n].get("activation_over_fp32")
        if ratio:
            ax.annotate(f"act. {ratio['median']:.2f}x", (i, acts[i] + copies[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("saved for backward per step (MB)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    hidden = "-".join(str(h) for h in data["hidden"])
    fig.suptitle(
        f"fp32 vs mixed precision, MLP 64-{hidden}-10, batch {data['batch_size']}, {data['accelerator_used']}"
        " (median, min-max over repeats; labels: ratio to fp32)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 1 + 3 steps: a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (20; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps left out (3; 1 with --quick)")
    parser.add_argument("--batch-size", type=int, default=256, help="batch size (256)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024], help="hidden widths (1024 1024)")
    parser.add_argument(
        "--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="configurations (fp32 bf16 fp16)"
    )
    parser.add_argument(
        "--accelerator", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when available, else CPU"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run on CPU (1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take before it is killed")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/results; a temp folder with --quick)"
    )
    opts = parser.parse_args()
    defaults = {"repeats": 1, "steps": 3, "warmup": 1} if opts.quick else {"repeats": 3, "steps": 20, "warmup": 3}
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    if BASE not in opts.configs:
        opts.configs = [BASE, *opts.configs]  # every ratio is against fp32
    opts.configs = list(dict.fromkeys(opts.configs))
    import torch

    if opts.accelerator == "auto":
        opts.accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if opts.out is None:  # a smoke test never overwrites the real results
        opts.out = Path(tempfile.mkdtemp(prefix="ds-precision-quick-")) if opts.quick else RESULTS
    start = time.monotonic()
    package_at_start = package_state()
    raw = run_all(opts)
    data: dict[str, Any] = {
        "package": package_at_start,
        "repeats": opts.repeats,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "batch_size": opts.batch_size,
        "hidden": opts.hidden,
        "threads": opts.threads,
        "accelerator_used": opts.accelerator,
        "torch": torch.__version__,
        "cpu": cpu_info(),
        "memory_measure": "cuda max_memory_allocated during fit"
        if opts.accelerator == "cuda"
        else "peak RSS growth over fit (ru_maxrss)",
        "summary": summarise(raw),
        "seconds": time.monotonic() - start,
        "raw": raw,
    }
    if opts.accelerator == "cuda":
        data["cuda_device"] = torch.cuda.get_device_name(0)
    if package_state() != package_at_start:  # every run imports the package afresh: say so if it changed
        data["package_at_end"] = package_state()
        print("  note: the package changed while the benchmark ran (see package / package_at_end)", flush=True)
    write_outputs(data, opts.out)
    print(f"wrote {opts.out}/precision.{{json,md,png}} in {data['seconds'] / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
