"""Is MixedPrecision("auto") ever slower than fp32? And what do bf16 and fp16 do to step time and memory?

The arms, the workloads, what is measured, the target and the options: README.md in this folder.

    python -m benchmarks.precision.driver [--quick] [--model digits|gpt] [--repeats 3] [--out DIR] [--render [JSON]]
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
HIDDEN = [1024, 1024]
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
COLUMNS = [("step_ms", ".1f"), ("step_ms_ratio", ".2f"), ("throughput", ".0f"), ("peak_mb", ".1f")]
COLUMNS += [("peak_mb_ratio", ".2f"), ("activation_mb", ".2f"), ("activation_mb_ratio", ".2f")]
COLUMNS += [("weight_copy_mb", ".2f"), ("final_loss", ".3f")]  # the table's figures after the arm and its precision
#: steps, warm-up and batch left unset: a full run, then --quick (the GPT's steps are slow under bf16 on a CPU)
FULL = {"digits": {"steps": 10, "warmup": 3, "batch_size": 256}, "gpt": {"steps": 6, "warmup": 2, "batch_size": 8}}
QUICK = {m: {"steps": 3, "warmup": 1} for m in FULL}


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


def verdict(ratio: dict[str, Any] | None, target: float) -> str:
    """``met`` when every launch's ratio is within ``target``, ``missed`` when none is, else ``within noise``."""
    if ratio is None:
        return "not measured"
    return "met" if ratio["max"] <= target else "missed" if ratio["min"] > target else "within noise"


class Precision(harness.Benchmark):
    name = "precision"
    description = __doc__
    models = ("digits", "gpt")

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, help="timed steps per run (digits 10, GPT 6; --quick: 3)")
        parser.add_argument("--warmup", type=int, help="warm-up steps left out (digits 3, GPT 2; --quick: 1)")
        parser.add_argument("--batch-size", type=int, help="batch size (digits 256, GPT 8)")
        parser.add_argument("--configs", nargs="+", choices=CONFIGS, help="arms (fp32 auto bf16; on CUDA fp16 too)")
        parser.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if any")
        parser.add_argument("--threads", type=int, default=1, help="torch threads per run on CPU (1)")
        parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (900)")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        import torch

        _workloads.fill_defaults(opts, FULL, QUICK)
        workload = _workloads.spec_of(opts)
        if opts.accelerator == "auto":
            opts.accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        cuda = opts.accelerator == "cuda"
        opts.configs = opts.configs or list(CONFIGS if cuda else CPU_CONFIGS)
        return {
            "workload": workload,
            "workload_label": _workloads.label(workload, HIDDEN),
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
        spec = {"precision": arm.name, "accelerator": opts.accelerator, "threads": opts.threads, "hidden": HIDDEN}
        spec.update(batch_size=opts.batch_size, lr=LR, warmup=opts.warmup, steps=opts.steps)
        spec["workload"] = _workloads.spec_of(opts)
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(opts.threads, rendezvous=False))
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
        why = f"; {r['decision']['reason']}" if r.get("decision") else ""
        return f"median step {r['step_ms']:.1f} ms, peak memory {r['peak_mb']:.1f} MB, in {r['chosen']}{why}"

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        # throughput is derived here, not recorded: samples (tokens on the GPT) per second at a run's median step
        per_step = data["settings"]["batch_size"] * block_of(data)
        records = [
            {**r, "throughput": per_step * 1000 / r["step_ms"]} if r.get("step_ms") else r for r in data["records"]
        ]
        s = harness.summarise(records, list(data["arms"]), KEYS, BASE)
        for arm in data["arms"]:
            s[arm]["chosen"] = sorted({r["chosen"] for r in harness.ok(records, arm)})
        s["verdicts"] = []
        if "auto" in s:
            auto = s["auto"]
            auto.update(target=AUTO_TARGET, verdict=verdict(auto.get("step_ms_ratio"), AUTO_TARGET))
            auto["chosen_per_launch"] = harness.values(records, "auto", "chosen")
            fp32_ms, probe = (s[BASE]["step_ms"] or {}).get("median"), auto.get("probe_s")
            auto["probe_in_fp32_steps"] = probe["median"] * 1000 / fp32_ms if probe and fp32_ms else None
            # the README's target by the harness's rule (the median); the page's every-launch verdict is stricter
            what = "auto / fp32 step time (median rule; the page's every-launch verdict is stricter)"
            s["verdicts"].append(harness.judged(what, auto.get("step_ms_ratio"), at_most=AUTO_TARGET, unit="x"))
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, cpu, st = data["summary"], data["cpu"], data["settings"]
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
                data["arms"][n] + (f" ({s[n]['failed_runs']} failed)" if s[n]["failed_runs"] else ""),
                ", ".join(s[n]["chosen"]) or "-",
                *(fmt(s[n].get(key), spec) for key, spec in COLUMNS),
            ]
            for n in data["arms"]
        ]
        head = ["configuration", "trained in", "step (ms)", "vs fp32", f"{unit}/s", "peak memory (MB)", "vs fp32"]
        head += ["activations saved (MB)", "vs fp32", "weight copies saved (MB)", "final train loss"]
        headline = self.headline(data)
        return [
            f"# fp32 against MixedPrecision on the {data['workload_label']}",
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
            *harness.markdown_table(head, rows),
            "",
            "**Reading**",
            "",
            *([f"- **{headline}**"] if headline else []),
            *findings(data),
            *auto_launches(data),
        ]

    def headline(self, data: dict[str, Any]) -> str | None:
        """auto's step time against fp32's (paired per launch), the verdict, and what its measuring cost."""
        auto = data["summary"].get("auto", {})
        ratio = auto.get("step_ms_ratio")
        if ratio is None:
            return None
        chosen = auto["chosen_per_launch"]
        picks = ", ".join(f"{c} {chosen.count(c)}x" for c in dict.fromkeys(chosen))
        line = (
            f"auto / fp32 step time (per launch, {len(ratio['runs'])} launches): {fmt(ratio, '.3f')}; target <="
            f" {AUTO_TARGET:.2f}: {auto['verdict']} (auto trained in {picks})"
        )
        if auto.get("probe_s"):
            line += f"; its measuring took {fmt(auto['probe_s'], '.2f')} s once"
            if auto.get("probe_in_fp32_steps"):
                line += f", {auto['probe_in_fp32_steps']:.0f} fp32 steps"
        return line

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        memory = "CUDA allocated" if data["accelerator_used"] == "cuda" else "RSS growth over fit"
        panels = [
            Panel("step_ms", "median step time (ms)", "step_ms_ratio"),
            Panel("throughput", f"{unit_of(data)} per second", "throughput_ratio"),
            Panel("peak_mb", f"peak memory (MB): {memory}", "peak_mb_ratio"),
            Panel("saved_mb", "saved for backward per step (MB; label: activations)", "activation_mb_ratio"),
        ]
        title = (
            f"fp32 vs mixed precision, {data['workload_label']}, batch {data['settings']['batch_size']}"
            f"{f' x {block_of(data)} tokens' if unit_of(data) == 'tokens' else ''},"
            f" {data['accelerator_used']} (median, min-max over launches; labels: ratio to fp32)"
        )
        path = out / f"{self.file_stem(data['settings'])}.png"
        harness.bar_panels(path, {a: data["summary"][a] for a in data["arms"]}, panels, title, COLORS)
        return [path]


def unit_of(data: dict[str, Any]) -> str:
    return "tokens" if data["workload"]["model"] == "gpt" else "samples"


def block_of(data: dict[str, Any]) -> int:
    return int(data["workload"].get("block_size", 1))


def trained(data: dict[str, Any]) -> str:
    """The module and optimizer that trained."""
    if unit_of(data) == "tokens":
        return "the demo `GPT` (AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1)"
    hidden = "-".join(str(h) for h in data["settings"].get("hidden", HIDDEN))  # an option until it was dropped
    return f"DigitsClassifier 64-{hidden}-10 (SGD lr {LR} momentum 0.9)"


def provenance_line(data: dict[str, Any]) -> list[str]:
    """Where the figures were measured (the harness's provenance block; none in fabricated data)."""
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
    for rep in sorted(k[1] for k in by if k[0] == "auto"):
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
    head = ["launch", "fp32 step (ms)", "auto step (ms)", "auto / fp32", "auto trained in"]
    head += ["auto measured (ms per forward + backward)", "measuring (s)"]
    return [
        "",
        "**auto, launch by launch.** Its rule: fp32 unless another precision's median pass beats fp32's by more than"
        " the larger of 5% and the noise (interquartile range over median) of the two candidates' passes. Verdict:"
        f" met when every launch's auto / fp32 is <= {AUTO_TARGET:.2f}, missed when none is, within noise otherwise.",
        "",
        *harness.markdown_table(head, rows),
    ]


def findings(data: dict[str, Any]) -> list[str]:
    """Plain-language reading of the medians."""
    s, out = data["summary"], []
    cpu = data["accelerator_used"] == "cpu"
    flags = data["cpu"].get("flags", [])
    native = [f for f in flags if "bf16" in f or "fp16" in f]
    for name in (n for n in data["arms"] if n != BASE and s[n].get("step_ms_ratio")):
        t, m, a = (s[name].get(f"{k}_ratio") for k in ("step_ms", "peak_mb", "activation_mb"))
        x = t["median"]
        speed = f", {x - 1:.0%} slower" if 1 <= x < 2 else "" if x >= 2 else f", a {1 / x:.2f}x speed-up"
        line = f"- {LABELS[name]}: {x:.2f}x the fp32 step time{speed}"
        if m is not None:
            line += f"; peak memory {m['median']:.2f}x fp32's"
        if a is not None:
            copies = s[name]["weight_copy_mb"]["median"] if s[name]["weight_copy_mb"] else 0.0
            line += f"; activations saved for backward {a['median']:.2f}x fp32's"
            if copies > 0:
                line += f", plus {copies:.2f} MB of autocast's low-precision weight copies, which fp32 does not need"
        out.append(line + ".")
        if name == "auto" and set(s[name]["chosen"]) == {BASE}:
            out.append(
                "  auto trained in fp32 in every launch, so past its first step it ran fp32's code path: read its"
                " ratio against the spread of fp32's own step time between launches."
            )
        if cpu and x > 1 and name != "auto":
            why = (
                f"even with {', '.join(native)}, the kernels used here and the casts cost more than fp32's"
                if native
                else "this CPU has no native bf16/fp16 matrix instructions (flags found:"
                f" {', '.join(flags) or 'none'}), so the low-precision matrix multiplications run without hardware"
                " support"
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
