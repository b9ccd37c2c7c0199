"""How fast is ds_mirrored? Against Lightning's ddp and a plain torch DDP loop, and per gradient_compression setting.

Every arm runs on 2 CPU processes (gloo, 1 thread each) and trains the ``--model`` workload
(``harness/workloads.py``): the 64-1024-1024-10 MLP on the digits (SGD, batch 32 per process), or the byte-level
GPT on the standard library's text (AdamW, batch 8 windows of 128 tokens per process); the benchmark harness
interleaves the arms and repeats them. Arms: ``ds_mirrored`` (no compression; also the ``none`` row of the compression
table), Lightning's ``ddp``, a plain torch DDP loop, ``ds_mirrored`` with ``gradient_compression`` fp16, bf16 and
powersgd, and ``ds_mirrored`` with ``gradient_compression="auto"`` (the strategy's defaults; ``--auto-interval`` sets
its probe interval). Step time is forward + backward + optimizer step (the harness's ``StepTimer``; the plain loop
times the same span by hand), median over the steps after the warm-up; throughput is the global batch (samples, or
tokens on the GPT) over that step time. Targets: ds_mirrored / Lightning ddp <= 1.00, ds_mirrored / plain loop <= 1.10,
auto / none <= 1.05 (per repeat; the report adds what auto chose, from the strategy's recorded decisions and link
figures, and the ratio of mean step times, which count the steps that probed the link).

    python -m benchmarks.mirrored.driver [--quick] [--model digits|gpt] [--repeats 3] [--out DIR] [--render [JSON]]
        [--steps 150] [--warmup 20] [--batch-size 32] [--auto-interval 500]
        [--gpt-layers 4 --gpt-heads 4 --gpt-width 128 --gpt-block 128]
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
from benchmarks.harness.figures import save_figure
from benchmarks.mirrored.auto import AUTO, LOOPBACK_TARGET, loopback_lines, loopback_summary

WORKER = Path(__file__).resolve().parent / "worker.py"
STRATEGIES = {
    "ds_mirrored": {"mode": "lightning", "strategy": "ds_mirrored", "compression": "none"},
    "lightning_ddp": {"mode": "lightning", "strategy": "ddp", "compression": "none"},
    "plain_ddp": {"mode": "plain"},
}
COMPRESSIONS = {"none": "ds_mirrored", "fp16": "fp16", "bf16": "bf16", "powersgd": "powersgd"}  # setting: arm
LINKS_MBIT = {"1 Gbit/s": 1000.0, "100 Mbit/s": 100.0}
TARGETS = {"lightning_ddp": ("Lightning ddp", 1.00), "plain_ddp": ("plain DDP loop", 1.10)}  # ds_mirrored / each
RATIOS = {arm: f"ds_mirrored / {name} (target <= {bound:.2f})" for arm, (name, bound) in TARGETS.items()}

#: per-workload defaults of the options left unset: a full run, then --quick (one GPT run: well under a minute)
MODEL_DEFAULTS = {
    "digits": ({"steps": 150, "warmup": 20, "batch_size": 32}, {"steps": 10, "warmup": 2}),
    "gpt": ({"steps": 30, "warmup": 5, "batch_size": 8}, {"steps": 4, "warmup": 2}),
}


def model_defaults(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill ``--steps``, ``--warmup`` and ``--batch-size`` left unset from the workload's full or quick defaults."""
    return _workloads.fill_defaults(
        opts, {m: d[0] for m, d in MODEL_DEFAULTS.items()}, {m: d[1] for m, d in MODEL_DEFAULTS.items()}
    )


def with_throughput(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The records, each run's throughput added: samples (tokens on the GPT) of the 2-process global batch per second
    at its median step time (derived here, so JSON written before it re-renders with it)."""
    per_step = 2 * data["settings"]["batch_size"] * block_of(data)
    return [{**r, "throughput": per_step * 1000 / r["step_ms"]} if r.get("step_ms") else r for r in data["records"]]


def bucket_view(settings: dict[str, Any]) -> str:
    """The baselines' ``gradient_as_bucket_view``, as the report says it (runs before the option had torch's False)."""
    view = settings.get("baseline_bucket_view", "false")
    return "True (like for like)" if view == "true" else "False (torch's default: not like for like)"


class Mirrored(harness.Benchmark):
    name = "mirrored"
    description = __doc__
    models = ("digits", "gpt")
    defaults = {"repeats": 3}  # harness.MIN_LAUNCHES: a verdict, and bench-all within its 2 hours
    quick = {"repeats": 1}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--steps", type=int, default=None, help="timed steps per run (digits 150, GPT 30; --quick: 10, 4)"
        )
        parser.add_argument(
            "--warmup", type=int, default=None, help="warm-up steps left out (digits 20, GPT 5; --quick: 2)"
        )
        parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024], help="hidden widths (1024 1024)")
        parser.add_argument("--batch-size", type=int, default=None, help="batch per process (digits 32, GPT 8)")
        parser.add_argument(
            "--auto-interval", type=int, default=None, help="the auto arm's auto_interval (the strategy's default, 500)"
        )
        parser.add_argument(
            "--baseline-bucket-view",
            choices=["true", "false"],
            default="true",
            help="gradient_as_bucket_view of the Lightning ddp and plain DDP baselines: true (default) is ds_mirrored's"
            " setting, like for like; false is torch's default",
        )
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (600)")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        model_defaults(opts)
        workload = _workloads.spec_of(opts)
        return {"workload": workload, "workload_label": _workloads.label(workload, opts.hidden)}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [Arm(n, p) for n, p in STRATEGIES.items()]
        arms += [
            Arm(c, {"mode": "lightning", "strategy": "ds_mirrored", "compression": c}, f"ds_mirrored {c}")
            for c in COMPRESSIONS
            if c != "none"
        ]
        auto = {"mode": "lightning", "strategy": "ds_mirrored", "compression": AUTO}
        arms.append(Arm(AUTO, auto, "ds_mirrored auto"))
        return Experiment(arms, opts.repeats, baseline="ds_mirrored")

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {**arm.params, "hidden": opts.hidden, "batch_size": opts.batch_size, "auto_interval": opts.auto_interval}
        spec["bucket_view"] = opts.baseline_bucket_view == "true"  # the baselines'; ds_mirrored's is its own (True)
        spec.update(steps=opts.steps, warmup=opts.warmup, workload=_workloads.spec_of(opts))
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1))
        r = found["result"]
        reading = {"rc": found["rc"], "step_ms": r["median_step_ms"]}
        keys = ("mean_step_ms", "comm_bytes_per_step", "uncompressed_bytes_per_step", "auto")
        reading.update({k: r[k] for k in keys if k in r})
        return reading

    def progress(self, record: dict[str, Any]) -> str:
        return f"{record['step_ms']:.2f} ms/step"

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        records = with_throughput(data)
        keys = ["step_ms", "throughput", "comm_bytes_per_step", "mean_step_ms"]
        s = harness.summarise(records, list(data["arms"]), keys)
        for arm in RATIOS:  # ds_mirrored over each reference, per repeat
            s["ds_mirrored"][f"over_{arm}"] = harness.paired(records, "ds_mirrored", arm, "step_ms")
        for setting, arm in COMPRESSIONS.items():
            v = s[arm]
            sent = v["comm_bytes_per_step"]["median"] if v["comm_bytes_per_step"] else None
            full = next((r.get("uncompressed_bytes_per_step") for r in harness.ok(records, arm)), None)
            step = v["step_ms"]["median"] if v["step_ms"] else None
            # Projection, not a measurement: loopback time plus the payload at the link rate (a 2-rank ring
            # all-reduce sends about the payload once per rank). cluster.py measures shaped links.
            v["compression"] = {
                "setting": setting,
                "bytes_per_step": sent,
                "uncompressed_bytes_per_step": full,
                "projected_step_ms": {
                    link: step + sent * 8 / (mbit * 1e6) * 1000 if step and sent else None
                    for link, mbit in LINKS_MBIT.items()
                },
            }
        if AUTO in s:  # results from before the auto arm have none
            st = data["settings"]
            s[AUTO]["auto"] = loopback_summary(records, "ds_mirrored", st["warmup"], st["steps"])
        s["verdicts"] = verdicts(s)
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, st = data["summary"], data["settings"]
        unit = unit_of(data)
        rows = [[n, fmt(s[n]["step_ms"], ".2f"), fmt(s[n].get("throughput"), ".0f")] for n in STRATEGIES]
        rows += [
            [f"**{label}**", f"**{fmt(s['ds_mirrored'][f'over_{a}'], '.3f')}**", ""] for a, label in RATIOS.items()
        ]
        comp_rows = []
        for arm in COMPRESSIONS.values():
            c = s[arm]["compression"]
            p = c["projected_step_ms"]
            share = (
                c["bytes_per_step"] / c["uncompressed_bytes_per_step"]
                if c["bytes_per_step"] and c["uncompressed_bytes_per_step"]
                else None
            )
            comp_rows.append(
                [
                    c["setting"],
                    f"{c['bytes_per_step'] / 1e6:.3f} MB" if c["bytes_per_step"] else "-",
                    f"{share:.3f}x" if share else "-",
                    fmt(s[arm]["step_ms"], ".2f"),
                    fmt(s[arm].get("throughput"), ".0f"),
                    *(f"{p[link]:.1f}" if p[link] else "-" for link in LINKS_MBIT),
                ]
            )
        failed = [f"{a}: {e}" for a in data["arms"] for e in s[a]["errors"]]
        return [
            f"# ds_mirrored on the {workload_label(data)}",
            "",
            f"2 CPU processes (gloo, 1 thread each), batch {st['batch_size']} per process, {st['warmup']} warm-up +"
            f" {st['steps']} timed steps per run, {st['repeats']} interleaved repeat(s). Median of per-run medians"
            f" [min - max]; ratios per repeat. Throughput: {unit}/s of the global batch"
            f" (2 x {st['batch_size']}{' x ' + str(block_of(data)) + ' tokens' if unit == 'tokens' else ''}) at a"
            " run's median step time. `gradient_as_bucket_view`: ds_mirrored True (its default); Lightning ddp and"
            f" the plain DDP loop {bucket_view(st)}.",
            "",
            *harness.markdown_table(["strategy", "step (ms)", f"{unit}/s"], rows),
            "",
            *harness.markdown_table(
                [
                    "gradient_compression",
                    "payload/step (counted)",
                    "vs none",
                    "loopback step (ms)",
                    f"loopback {unit}/s",
                    "projected @1 Gbit/s",
                    "projected @100 Mbit/s",
                ],
                comp_rows,
            ),
            *(loopback_lines(s, "ds_mirrored", st) if AUTO in s else []),
            *(["", "Failed runs:", *(f"- {f}" for f in failed)] if failed else []),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        s = data["summary"]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        names = [n for n in [*STRATEGIES, AUTO] if n in s and s[n]["step_ms"]]
        med = [s[n]["step_ms"]["median"] for n in names]
        err = [
            [m - s[n]["step_ms"]["min"] for n, m in zip(names, med, strict=True)],
            [s[n]["step_ms"]["max"] - m for n, m in zip(names, med, strict=True)],
        ]
        colors = ["tab:blue", "tab:orange", "tab:gray", "tab:green"][: len(names)]
        bars = ax1.bar(names, med, yerr=err, capsize=4, color=colors)
        rates = [s[n]["throughput"]["median"] if s[n].get("throughput") else None for n in names]
        ax1.bar_label(bars, [f"{r:.0f} {unit_of(data)}/s" if r else "" for r in rates], label_type="center", fontsize=8)
        ax1.set_ylabel("median step time (ms)")
        ax1.set_title(f"2 CPU procs, {data.get('workload', {}).get('model', 'digits')} (min-max over repeats)")
        comp = [a for a in COMPRESSIONS.values() if s[a]["compression"]["bytes_per_step"]]
        x = list(range(len(comp)))
        ax2.bar(
            [i - 0.2 for i in x],
            [s[a]["compression"]["bytes_per_step"] / 1e6 for a in comp],
            width=0.4,
            label="MB sent / step",
        )
        ax2.set_ylabel("MB per step per rank")
        ax2.set_xticks(x, [s[a]["compression"]["setting"] for a in comp])
        twin = ax2.twinx()
        twin.bar(
            [i + 0.2 for i in x],
            [s[a]["step_ms"]["median"] for a in comp],
            width=0.4,
            color="tab:orange",
            label="loopback ms",
        )
        twin.plot(
            x,
            [s[a]["compression"]["projected_step_ms"]["100 Mbit/s"] for a in comp],
            "k^--",
            label="projected ms @100 Mbit/s",
        )
        twin.set_ylabel("step time (ms)")
        twin.set_yscale("log")
        ax2.set_title("ds_mirrored gradient_compression")
        handles = ax2.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax2.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
        fig.suptitle(f"ds_mirrored on the {workload_label(data)}", fontsize=9)
        fig.tight_layout()
        path = out / f"{harness.stem(self, data['settings'].get('model'))}.png"
        save_figure(fig, path)
        return [path]


def verdicts(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, per repeat: ds_mirrored against each reference's step time, and auto against none."""
    out = [
        harness.judged(f"ds_mirrored / {name} step time", s["ds_mirrored"][f"over_{arm}"], at_most=bound, unit="x")
        for arm, (name, bound) in TARGETS.items()
    ]
    if AUTO in s:
        out.append(
            harness.judged(
                "auto / none step time on loopback", s[AUTO]["auto"]["over_none"], at_most=LOOPBACK_TARGET, unit="x"
            )
        )
    return out


def unit_of(data: dict[str, Any]) -> str:
    """What throughput counts: tokens on the GPT, samples on the digits (JSON from before ``--model``: digits)."""
    return "tokens" if data.get("workload", {}).get("model") == "gpt" else "samples"


def block_of(data: dict[str, Any]) -> int:
    """Tokens per sample: the GPT's context, 1 for the digits."""
    return int(data.get("workload", {}).get("block_size", 1))


def workload_label(data: dict[str, Any]) -> str:
    """The workload's name; JSON from before ``--model`` trained the digits MLP of its ``hidden``."""
    return data.get("workload_label") or _workloads.label({"model": "digits"}, data["settings"].get("hidden"))


if __name__ == "__main__":
    harness.main(Mirrored())
