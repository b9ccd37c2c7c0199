"""Is MixedPrecision("auto") ever slower than fp32? And what do bf16 and fp16 do to step time and memory?

Trains the ``--model`` workload (``benchmarks/harness/workloads.py``): the digits classifier (``DigitsClassifier``,
64-1024-1024-10 by default, SGD lr 0.05 momentum 0.9, batch 256) or the demo ``GPT`` (AdamW lr 3e-4, batch 8 windows of
128 tokens) on the standard library's text, in one process (1 thread on CPU; the GPU when CUDA is available, unless
``--accelerator cpu``), once per arm and launch: *fp32* (no callback), *auto* (``MixedPrecision("auto")``: it times
the model's own step in each precision on the first batch and keeps fp32 unless another wins by more than the noise),
*bf16* (``MixedPrecision("bf16")``: bf16 autocast, fp32 parameters and optimizer) and *fp16*
(``MixedPrecision("fp16")``: fp16 autocast with a ``GradScaler``; by default only on CUDA, where it can pay: on a CPU
without native fp16 it is an order of magnitude slower). Throughput: samples (or tokens on the GPT) per second at a
run's median step time.

Target (issue 25): auto never slower than fp32 by more than 10%: auto's step time / fp32's, paired per launch, median
over the launches <= 1.10. Verdict: *met* when every launch's ratio is within it, *missed* when none is, *within
noise* when the launches fall on both sides of it. Auto's measuring is paid once, inside its first step (a warm-up
step, left out of the step time); its duration is reported apart, also in fp32 steps.

Every run is a fresh process (so its peak RSS is its own); the arms are interleaved by the benchmark harness, each
launch starting one arm later (fp32 auto bf16, auto bf16 fp32, ...). Step time: the harness's ``StepTimer`` (batch
start to batch end), median over the steps after the warm-up. Peak memory: on CPU, how much the process's peak RSS
(``ru_maxrss``) grew during ``fit``; on CUDA, ``max_memory_allocated()``. Saved for backward: bytes autograd keeps for
backward in one step (each storage once, parameters excluded), split into activations and autocast's low-precision
weight copies. Ratios are per launch against that launch's fp32 run.

    python -m benchmarks.precision.driver [--quick] [--model digits|gpt] [--repeats 3] [--out DIR] [--render [JSON]]
        [--steps 10 (GPT: 6)] [--warmup 3 (GPT: 2)] [--batch-size 256 (GPT: 8)] [--hidden 1024 1024]
        [--configs fp32 auto bf16 (CUDA: and fp16)] [--accelerator auto|cpu|cuda]
        [--gpt-layers 4 --gpt-heads 4 --gpt-width 128 --gpt-block 128]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, Panel, fmt
from benchmarks.harness import workloads as _workloads

WORKER = Path(__file__).resolve().parent / "worker.py"
LR = 0.05
BASE = "fp32"
CONFIGS = ("fp32", "auto", "bf16", "fp16")
CPU_CONFIGS = ("fp32", "auto", "bf16")  # fp16 on a CPU without native fp16: 10-20x fp32, minutes per launch
LABELS = {
    "fp32": "fp32 (no callback)",
    "bf16": 'MixedPrecision("bf16")',
    "fp16": 'MixedPrecision("fp16")',
    "auto": 'MixedPrecision("auto")',
}
COLORS = {"fp32": "tab:gray", "bf16": "tab:blue", "fp16": "tab:orange", "auto": "tab:green"}
KEYS = ("step_ms", "throughput", "peak_mb", "activation_mb", "weight_copy_mb", "saved_mb", "final_loss", "probe_s")
AUTO_TARGET = 1.10  # auto's step time / fp32's, per launch: never slower than fp32 by more than 10%
MB = 1024**2
#: per-workload defaults of the options left unset: a full run, then --quick (fp16 on a CPU without native fp16 takes
#: ~4 s per GPT step, so the GPT's runs are short)
MODEL_DEFAULTS = {
    "digits": ({"steps": 10, "warmup": 3, "batch_size": 256}, {"steps": 3, "warmup": 1}),
    "gpt": ({"steps": 6, "warmup": 2, "batch_size": 8}, {"steps": 3, "warmup": 1}),
}


def model_defaults(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill ``--steps``, ``--warmup`` and ``--batch-size`` left unset from the workload's full or quick defaults."""
    return _workloads.fill_defaults(
        opts, {m: d[0] for m, d in MODEL_DEFAULTS.items()}, {m: d[1] for m, d in MODEL_DEFAULTS.items()}
    )


def cpu_info() -> dict[str, Any]:
    """The CPU's name, and which bf16 / fp16 matrix instructions it lists (for the report: auto never reads them)."""
    info: dict[str, Any] = {"machine": platform.machine(), "cores": os.cpu_count()}
    info["model"] = harness.cpu_model() or "unknown"
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), set())
        wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")
        info["flags"] = [f for f in wanted if f in flags]
    return info


class Precision(harness.Benchmark):
    name = "precision"
    description = __doc__
    models = ("digits", "gpt")
    defaults = {"repeats": 3}
    quick = {"repeats": 1}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--steps", type=int, default=None, help="timed steps per run (digits 10, GPT 6; --quick: 3)"
        )
        parser.add_argument(
            "--warmup", type=int, default=None, help="warm-up steps left out (digits 3, GPT 2; --quick: 1)"
        )
        parser.add_argument("--batch-size", type=int, default=None, help="batch size (digits 256, GPT 8)")
        parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024], help="hidden widths (1024 1024)")
        parser.add_argument(
            "--configs", nargs="+", choices=CONFIGS, default=None, help="arms (fp32 auto bf16; on CUDA fp16 too)"
        )
        parser.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if any")
        parser.add_argument("--threads", type=int, default=1, help="torch threads per run on CPU (1)")
        parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (900)")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        import torch

        model_defaults(opts)
        workload = _workloads.spec_of(opts)
        if opts.accelerator == "auto":
            opts.accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        cuda = opts.accelerator == "cuda"
        if opts.configs is None:
            opts.configs = list(CONFIGS if cuda else CPU_CONFIGS)
        return {
            "workload": workload,
            "workload_label": _workloads.label(workload, opts.hidden),
            "accelerator_used": opts.accelerator,
            "torch": torch.__version__,
            "cpu": cpu_info(),
            "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
            "memory_measure": "cuda max_memory_allocated during fit"
            if cuda
            else "peak RSS growth over fit (ru_maxrss)",
        }

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        names = list(dict.fromkeys([BASE, *opts.configs]))  # every ratio is against fp32
        return Experiment([Arm(n, label=LABELS[n]) for n in names], opts.repeats, baseline=BASE)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {
            "precision": arm.name,
            "accelerator": opts.accelerator,
            "threads": opts.threads,
            "batch_size": opts.batch_size,
            "hidden": opts.hidden,
            "lr": LR,
            "warmup": opts.warmup,
            "steps": opts.steps,
            "workload": _workloads.spec_of(opts),
        }
        env = harness.worker_env(opts.threads, rendezvous=False)
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, env)
        r = found["result"]
        activation, copies = max(r["activation_bytes"]) / MB, max(r["weight_copy_bytes"]) / MB
        return {
            "rc": found["rc"],
            "chosen": r["chosen"],
            "decision": r.get("decision"),
            "probe_s": r.get("probe_seconds"),
            "step_ms": r["median_step_ms"],
            "peak_mb": r.get("cuda_peak_allocated_bytes", r["peak_rss_delta_bytes"]) / MB,
            "peak_rss_after_mb": r["peak_rss_after_bytes"] / MB,
            "activation_mb": activation,
            "weight_copy_mb": copies,
            "saved_mb": activation + copies,
            "final_loss": r["loss"][-1],
        }

    def progress(self, r: dict[str, Any]) -> str:
        return (
            f"median step {r['step_ms']:.1f} ms, peak memory {r['peak_mb']:.1f} MB, saved for backward"
            f" {r['activation_mb']:.2f} MB activations + {r['weight_copy_mb']:.2f} MB weight copies, final loss"
            f" {r['final_loss']:.3f} (trained in {r['chosen']})"
            + (f"; measured for {r['probe_s']:.1f} s: {r['decision']['reason']}" if r.get("decision") else "")
        )

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        records, arms = with_throughput(data), list(data["arms"])
        s = harness.summarise(records, arms, KEYS, BASE)
        for arm in arms:
            s[arm]["chosen"] = sorted({r["chosen"] for r in harness.ok(records, arm)})
        if "auto" in s:
            auto = s["auto"]
            auto["target"] = AUTO_TARGET
            auto["verdict"] = verdict(auto.get("step_ms_ratio"), AUTO_TARGET)
            auto["chosen_per_launch"] = harness.values(records, "auto", "chosen")
            fp32_ms = s[BASE]["step_ms"]["median"] if s.get(BASE, {}).get("step_ms") else None
            probe = auto.get("probe_s")
            auto["probe_in_fp32_steps"] = probe["median"] * 1000 / fp32_ms if probe and fp32_ms else None
        # The README's target by the harness's rule (the median); the page's every-launch verdict is stricter.
        what = "auto / fp32 step time (median rule; the page's every-launch verdict is stricter)"
        ratio = s.get("auto", {}).get("step_ms_ratio")
        s["verdicts"] = [harness.judged(what, ratio, at_most=AUTO_TARGET, unit="x")] if "auto" in s else []
        return s

    def headline(self, data: dict[str, Any]) -> str | None:
        """auto's step time against fp32's (paired per launch), the verdict, and what its measuring cost."""
        auto = data["summary"].get("auto", {})
        ratio = auto.get("step_ms_ratio")
        if ratio is None:
            return None
        chosen = auto.get("chosen_per_launch") or []
        picks = ", ".join(f"{c} {chosen.count(c)}x" for c in dict.fromkeys(chosen))
        line = (
            f"auto / fp32 step time (per launch, {len(ratio['runs'])} launches): {fmt(ratio, '.3f')}; target <="
            f" {AUTO_TARGET:.2f}: {auto.get('verdict', verdict(ratio, AUTO_TARGET))} (auto trained in {picks})"
        )
        if auto.get("probe_s"):
            line += f"; its measuring took {fmt(auto['probe_s'], '.2f')} s once"
            if auto.get("probe_in_fp32_steps"):
                line += f", {auto['probe_in_fp32_steps']:.0f} fp32 steps"
        return line

    def report(self, data: dict[str, Any]) -> list[str]:
        s, cpu = data["summary"], data["cpu"]
        st = data["settings"]
        unit = unit_of(data)
        if data["accelerator_used"] == "cuda":
            device = f"CUDA ({data.get('cuda_device') or 'GPU'})"
            memory = "peak `torch.cuda.max_memory_allocated()` during `fit`"
        else:
            flags = ", ".join(cpu.get("flags", [])) or "none of note"
            device = f"CPU ({cpu.get('model', 'unknown')}, {st['threads']} torch thread(s); flags: {flags})"
            memory = "growth of the process's peak resident set size (`ru_maxrss`) over `fit`, a fresh process per run"
        rows = [
            [
                data["arms"][n] + (f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""),
                ", ".join(v["chosen"]) or "-",
                fmt(v["step_ms"]),
                fmt(v.get("step_ms_ratio"), ".2f"),
                fmt(v.get("throughput"), ".0f"),
                fmt(v["peak_mb"]),
                fmt(v.get("peak_mb_ratio"), ".2f"),
                fmt(v["activation_mb"], ".2f"),
                fmt(v.get("activation_mb_ratio"), ".2f"),
                fmt(v["weight_copy_mb"], ".2f"),
                fmt(v["final_loss"], ".3f"),
            ]
            for n, v in ((n, s[n]) for n in data["arms"])
        ]
        headline = self.headline(data)
        return [
            f"# fp32 against MixedPrecision on the {workload_label(data)}",
            "",
            f"One process on {device}, {trained(data)}, batch {st['batch_size']}"
            f"{f' windows of {block_of(data)} tokens' if unit == 'tokens' else ''}, {st['warmup']} warm-up +"
            f" {st['steps']} timed steps per run, {st['repeats']} interleaved launch(es) per arm, every run a fresh"
            " process.",
            *provenance_line(data),
            "Step time: batch start to batch end (forward, backward, optimizer step), median over a run's timed steps;"
            f" throughput: {unit} per second at that step time."
            f" **Peak memory: {memory}.** Saved for backward: bytes autograd keeps for backward in one step (the"
            " largest step; each storage once; parameters excluded), split into activations and autocast's"
            " low-precision weight copies. Median [min - max] over launches; ratios per launch against that launch's"
            " fp32 run.",
            "",
            *harness.markdown_table(
                [
                    "configuration",
                    "trained in",
                    "step (ms)",
                    "vs fp32",
                    f"{unit}/s",
                    "peak memory (MB)",
                    "vs fp32",
                    "activations saved (MB)",
                    "vs fp32",
                    "weight copies saved (MB)",
                    "final train loss",
                ],
                rows,
            ),
            "",
            "**Reading**",
            "",
            *([f"- **{headline}**"] if headline else []),
            *findings(data),
            *auto_launches(data),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        gpu = data["accelerator_used"] == "cuda"
        panels = [
            Panel("step_ms", "median step time (ms)", "step_ms_ratio"),
            Panel("throughput", f"{unit_of(data)} per second", "throughput_ratio"),
            Panel(
                "peak_mb", "peak memory (MB): " + ("CUDA allocated" if gpu else "RSS growth over fit"), "peak_mb_ratio"
            ),
            Panel("saved_mb", "saved for backward per step (MB; label: activations)", "activation_mb_ratio"),
        ]
        title = (
            f"fp32 vs mixed precision, {workload_label(data)}, batch {data['settings']['batch_size']}"
            f"{f' x {block_of(data)} tokens' if unit_of(data) == 'tokens' else ''},"
            f" {data['accelerator_used']} (median, min-max over launches; labels: ratio to fp32)"
        )
        path = out / f"{harness.stem(self, data['settings'].get('model'))}.png"
        harness.bar_panels(path, {a: data["summary"][a] for a in data["arms"]}, panels, title, COLORS)
        return [path]


def unit_of(data: dict[str, Any]) -> str:
    """What throughput counts: tokens on the GPT, samples on the digits (JSON from before ``--model``: digits)."""
    return "tokens" if data.get("workload", {}).get("model") == "gpt" else "samples"


def block_of(data: dict[str, Any]) -> int:
    """Tokens per sample: the GPT's context, 1 for the digits."""
    return int(data.get("workload", {}).get("block_size", 1))


def with_throughput(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The records, each run's throughput added: samples (tokens on the GPT) per second at its median step time
    (derived here, so JSON written before it re-renders with it)."""
    per_step = data["settings"]["batch_size"] * block_of(data)
    return [{**r, "throughput": per_step * 1000 / r["step_ms"]} if r.get("step_ms") else r for r in data["records"]]


def workload_label(data: dict[str, Any]) -> str:
    """The workload's name; JSON from before ``--model`` trained the digits MLP of its ``hidden``."""
    return data.get("workload_label") or _workloads.label({"model": "digits"}, data["settings"].get("hidden"))


def trained(data: dict[str, Any]) -> str:
    """The module and optimizer that trained."""
    if unit_of(data) == "tokens":
        return "the demo `GPT` (AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1)"
    hidden = "-".join(str(h) for h in data["settings"]["hidden"])
    return f"DigitsClassifier 64-{hidden}-10 (SGD lr {LR} momentum 0.9)"


def verdict(ratio: dict[str, Any] | None, target: float) -> str:
    """``met`` when every launch's ratio is within ``target``, ``missed`` when none is, else ``within noise``."""
    if ratio is None:
        return "not measured"
    if ratio["max"] <= target:
        return "met"
    if ratio["min"] > target:
        return "missed"
    return "within noise"


def provenance_line(data: dict[str, Any]) -> list[str]:
    """Where the figures were measured (the harness's provenance block; absent in older files)."""
    p = data.get("provenance")
    if not p:
        return []
    commit = (p.get("commit") or "unrecorded")[:10] + (" + uncommitted changes" if p.get("uncommitted") else "")
    return [
        f"Measured at commit {commit} on {str(p.get('date') or 'unrecorded')[:10]}: {p.get('cpu_model')},"
        f" {p.get('cores')} cores, torch {p.get('torch')}, Lightning {p.get('lightning')}"
        + (f", {p['cuda_device']}" if p.get("cuda_device") else "")
        + ". The machine was shared with other work while it ran: spreads are wide.",
    ]


def auto_launches(data: dict[str, Any]) -> list[str]:
    """Per launch: fp32's and auto's step time, what auto measured on its first batch, and what it chose."""
    by = {(r["arm"], r["repeat"]): r for r in harness.ok(data["records"])}
    rows = []
    for rep in sorted({k[1] for k in by if k[0] == "auto"}):
        auto, base = by[("auto", rep)], by.get((BASE, rep))
        measured = (auto.get("decision") or {}).get("median_ms", {})
        rows.append(
            [
                rep + 1,
                f"{base['step_ms']:.1f}" if base else "-",
                f"{auto['step_ms']:.1f}",
                f"{auto['step_ms'] / base['step_ms']:.3f}" if base else "-",
                auto["chosen"],
                ", ".join(f"{c} {ms:.2f}" for c, ms in measured.items()) or "-",
                f"{auto['probe_s']:.2f}" if auto.get("probe_s") is not None else "-",
            ]
        )
    if not rows:
        return []
    return [
        "",
        "**auto, launch by launch.** Its rule: fp32 unless another precision's median pass beats fp32's by more than"
        " the larger of 5% and the noise (interquartile range over median) of the two candidates' passes. Verdict:"
        f" met when every launch's auto / fp32 is <= {AUTO_TARGET:.2f}, missed when none is, within noise otherwise.",
        "",
        *harness.markdown_table(
            [
                "launch",
                "fp32 step (ms)",
                "auto step (ms)",
                "auto / fp32",
                "auto trained in",
                "auto measured (ms per forward + backward)",
                "measuring (s)",
            ],
            rows,
        ),
    ]


def findings(data: dict[str, Any]) -> list[str]:
    """Plain-language reading of the medians."""
    s, out = data["summary"], []
    cpu = data["accelerator_used"] == "cpu"
    flags = data["cpu"].get("flags", [])
    native = [f for f in flags if "bf16" in f or "fp16" in f]
    for name in (n for n in data["arms"] if n != BASE):
        t, m, a = s[name].get("step_ms_ratio"), s[name].get("peak_mb_ratio"), s[name].get("activation_mb_ratio")
        if t is None:
            continue
        speed = f"{t['median']:.2f}x the fp32 step time" + (
            f", {t['median'] - 1:.0%} slower"
            if 1 <= t["median"] < 2
            else ""
            if t["median"] >= 2
            else f", a {1 / t['median']:.2f}x speed-up"
        )
        line = f"- {LABELS[name]}: {speed}"
        if m is not None:
            line += f"; peak memory {m['median']:.2f}x fp32's"
        if a is not None:
            copies = s[name]["weight_copy_mb"]["median"] if s[name]["weight_copy_mb"] else 0.0
            line += f"; activations saved for backward {a['median']:.2f}x fp32's"
            if copies > 0:
                line += f", plus {copies:.2f} MB of autocast's low-precision weight copies, which fp32 does not need"
        out.append(line + ".")
        if name == "auto" and set(s[name].get("chosen", [])) == {BASE}:
            out.append(
                "  auto trained in fp32 in every launch, so past its first step it ran fp32's code path: read its"
                " ratio against the spread of fp32's own step time between launches."
            )
        if cpu and t["median"] > 1 and name != "auto":
            why = (
                f"this CPU has no native bf16/fp16 matrix instructions (flags found: {', '.join(flags) or 'none'}),"
                " so the low-precision matrix multiplications run without hardware support"
                if not native
                else f"even with {', '.join(native)}, the kernels used here and the casts cost more than fp32's"
            )
            out.append(f"  {LABELS[name]} is slower than fp32 on this CPU: {why}; mixed precision can buy memory only.")
    if cpu:
        out.append(
            "- Peak RSS is a coarse measure (a high-water mark of the whole process, allocator caching included);"
            " the saved-for-backward columns count what mixed precision changes directly."
        )
    return out


if __name__ == "__main__":
    harness.main(Precision())
