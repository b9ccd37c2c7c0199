"""Is MixedPrecision("auto") ever slower than fp32? And what do bf16 and fp16 do to step time and memory?

Arms, workloads, what is measured, the target and the options: README.md in this folder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, Panel, fmt
from benchmarks.harness import workloads as _workloads

WORKER = Path(__file__).resolve().parent / "worker.py"
LR, HIDDEN, BASE = 0.05, [1024, 1024], "fp32"
CONFIGS = ("fp32", "auto", "bf16", "fp16")
CPU_CONFIGS = ("fp32", "auto", "bf16")  # fp16 on a CPU without native fp16: 10-20x fp32, minutes per launch
LABELS = {"fp32": "fp32 (no callback)", **{c: f'MixedPrecision("{c}")' for c in ("bf16", "fp16", "auto")}}
COLORS = {"fp32": "tab:gray", "bf16": "tab:blue", "fp16": "tab:orange", "auto": "tab:green"}
KEYS = ("step_ms", "throughput", "peak_mb", "activation_mb", "weight_copy_mb", "saved_mb", "final_loss", "probe_s")
AUTO_TARGET = 1.10  # auto's step time / fp32's, per launch: never slower than fp32 by more than 10%
MB = 1024**2
#: the table's figures after the arm and its precision
COLUMNS = [("step_ms", ".1f"), ("step_ms_ratio", ".2f"), ("throughput", ".0f"), ("peak_mb", ".1f")]
COLUMNS += [("peak_mb_ratio", ".2f"), ("activation_mb", ".2f"), ("activation_mb_ratio", ".2f")]
COLUMNS += [("weight_copy_mb", ".2f"), ("final_loss", ".3f")]
#: steps, warm-up and batch left unset: a full run, then --quick (the GPT's steps are slow under bf16 on a CPU)
FULL = {"digits": {"steps": 10, "warmup": 3, "batch_size": 256}, "gpt": {"steps": 6, "warmup": 2, "batch_size": 8}}
QUICK = {m: {"steps": 3, "warmup": 1} for m in FULL}
TRAINED = {
    "gpt": "the demo `GPT` (AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1)",
    "digits": f"DigitsClassifier 64-{'-'.join(map(str, HIDDEN))}-10 (SGD lr {LR} momentum 0.9)",
}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")


def cpu_info() -> dict[str, Any]:
    """The CPU's name, and which bf16 / fp16 matrix instructions it lists (for the report: auto never reads them)."""
    info: dict[str, Any] = {"machine": platform.machine(), "cores": os.cpu_count()}
    info["model"] = harness.cpu_model() or "unknown"
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), set())
        info["flags"] = [f for f in CPU_FLAGS if f in flags]
    return info


def verdict(ratio: dict[str, Any] | None, target: float) -> str:
    """``met`` when every launch's ratio is within ``target``, ``missed`` when none is, else ``within noise``."""
    if ratio is None:
        return "not measured"
    return "met" if ratio["max"] <= target else "missed" if ratio["min"] > target else "within noise"


def block_of(data: dict[str, Any]) -> int:
    """Tokens per sample: the GPT's context, 1 for the digits."""
    return int(data["workload"].get("block_size", 1))


def tokens(data: dict[str, Any], sep: str) -> str:
    """The GPT's window size after the batch (``sep`` joins them), nothing for the digits."""
    return f"{sep}{block_of(data)} tokens" if data["workload"]["model"] == "gpt" else ""


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
        memory = "cuda max_memory_allocated during fit" if cuda else "peak RSS growth over fit (ru_maxrss)"
        meta = {"workload": workload, "workload_label": _workloads.label(workload, HIDDEN)}
        meta.update(accelerator_used=opts.accelerator, torch=torch.__version__, cpu=cpu_info())
        return {**meta, "cuda_device": torch.cuda.get_device_name(0) if cuda else None, "memory_measure": memory}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        names = list(dict.fromkeys([BASE, *opts.configs]))  # every ratio is against fp32
        return Experiment([Arm(n, label=LABELS[n]) for n in names], opts.repeats, baseline=BASE)

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {"precision": arm.name, "accelerator": opts.accelerator, "threads": opts.threads, "hidden": HIDDEN}
        spec.update(batch_size=opts.batch_size, lr=LR, warmup=opts.warmup, steps=opts.steps)
        spec["workload"] = _workloads.spec_of(opts)
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(opts.threads, rendezvous=False))
        r = found["result"]
        act, copies = max(r["activation_bytes"]) / MB, max(r["weight_copy_bytes"]) / MB
        peak = r.get("cuda_peak_allocated_bytes", r["peak_rss_delta_bytes"]) / MB
        out = {"rc": found["rc"], "chosen": r["chosen"], "decision": r.get("decision")}
        out.update(probe_s=r.get("probe_seconds"), step_ms=r["median_step_ms"], peak_mb=peak)
        out.update(peak_rss_after_mb=r["peak_rss_after_bytes"] / MB, activation_mb=act, weight_copy_mb=copies)
        return {**out, "saved_mb": act + copies, "final_loss": r["loss"][-1]}

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
        gpt = data["workload"]["model"] == "gpt"
        if data["accelerator_used"] == "cuda":
            device, memory = f"CUDA ({data.get('cuda_device') or 'GPU'})", "CUDA max_memory_allocated"
        else:
            flags = ", ".join(cpu.get("flags", [])) or "none of note"
            device = f"CPU ({cpu.get('model', 'unknown')}, {st['threads']} torch thread(s); flags: {flags})"
            memory = "peak RSS growth over fit"
        trained = TRAINED["gpt" if gpt else "digits"]
        rows = [
            [
                data["arms"][n] + (f" ({s[n]['failed_runs']} failed)" if s[n]["failed_runs"] else ""),
                ", ".join(s[n]["chosen"]) or "-",
                *(fmt(s[n].get(key), spec) for key, spec in COLUMNS),
            ]
            for n in data["arms"]
        ]
        head = ["configuration", "trained in", "step (ms)", "vs fp32", f"{'tokens' if gpt else 'samples'}/s"]
        head += ["peak memory (MB)", "vs fp32", "activations saved (MB)", "vs fp32", "weight copies saved (MB)"]
        return [
            f"# fp32 against MixedPrecision on the {data['workload_label']}",
            "",
            f"One process on {device}, {trained}, batch {st['batch_size']}{tokens(data, ' windows of ')},"
            f" {st['warmup']} warm-up + {st['steps']} timed steps per run, {st['repeats']} interleaved launch(es) per"
            " arm, every run a fresh process.",
            f"Peak memory: {memory}. Median [min - max] over launches; ratios per launch against that launch's"
            " fp32 run. Method: [the README](../precision/README.md).",
            "",
            *harness.markdown_table([*head, "final train loss"], rows),
            *self.headline(data["summary"].get("auto", {})),
        ]

    def headline(self, auto: dict[str, Any]) -> list[str]:
        """auto's step time against fp32's (paired per launch), the verdict, and what its measuring cost."""
        if (ratio := auto.get("step_ms_ratio")) is None:
            return []
        chosen = auto["chosen_per_launch"]
        picks = ", ".join(f"{c} {chosen.count(c)}x" for c in dict.fromkeys(chosen))
        line = (
            f"auto / fp32 step time (per launch, {len(ratio['runs'])} launches): {fmt(ratio, '.3f')}; target <="
            f" {AUTO_TARGET:.2f} in every launch: {auto['verdict']} (auto trained in {picks})"
        )
        if auto.get("probe_s"):
            line += f"; its measuring took {fmt(auto['probe_s'], '.2f')} s once"
            if auto.get("probe_in_fp32_steps"):
                line += f", {auto['probe_in_fp32_steps']:.0f} fp32 steps"
        return ["", f"**{line}**"]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        memory = "CUDA allocated" if data["accelerator_used"] == "cuda" else "RSS growth over fit"
        unit = "tokens" if data["workload"]["model"] == "gpt" else "samples"
        panels = [
            Panel("step_ms", "median step time (ms)", "step_ms_ratio"),
            Panel("throughput", f"{unit} per second", "throughput_ratio"),
            Panel("peak_mb", f"peak memory (MB): {memory}", "peak_mb_ratio"),
            Panel("saved_mb", "saved for backward per step (MB; label: activations)", "activation_mb_ratio"),
        ]
        title = (
            f"fp32 vs mixed precision, {data['workload_label']}, batch {data['settings']['batch_size']}"
            f"{tokens(data, ' x ')}, {data['accelerator_used']} (median, min-max over launches; labels: ratio to fp32)"
        )
        path = out / f"{self.file_stem(data['settings'])}.png"
        harness.bar_panels(path, {a: data["summary"][a] for a in data["arms"]}, panels, title, COLORS)
        return [path]


if __name__ == "__main__":
    harness.main(Precision())
