"""How fast is ds_mirrored? Against Lightning's ddp and a plain torch DDP loop, and per gradient_compression setting.

Every arm runs on 2 CPU processes (gloo, 1 thread each) with the 64-1024-1024-10 MLP on the digits, batch 32 per
process; the benchmark harness interleaves the arms and repeats them. Arms: ``ds_mirrored`` (no compression; also the
``none`` row of the compression table), Lightning's ``ddp``, a plain torch DDP loop, and ``ds_mirrored`` with
``gradient_compression`` fp16, bf16 and powersgd. Step time is forward + backward + optimizer step (the harness's
``StepTimer``; the plain loop times the same span by hand), median over the steps after the warm-up. Targets:
ds_mirrored / Lightning ddp <= 1.00, ds_mirrored / plain loop <= 1.10.

    python benchmarks/mirrored.py [--quick] [--repeats 5] [--out DIR] [--render [JSON]] [--steps 150] [--warmup 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, fmt

WORKER = Path(__file__).resolve().parent / "_mirrored_worker.py"
STRATEGIES = {
    "ds_mirrored": {"mode": "lightning", "strategy": "ds_mirrored", "compression": "none"},
    "lightning_ddp": {"mode": "lightning", "strategy": "ddp", "compression": "none"},
    "plain_ddp": {"mode": "plain"},
}
COMPRESSIONS = {"none": "ds_mirrored", "fp16": "fp16", "bf16": "bf16", "powersgd": "powersgd"}  # setting: arm
LINKS_MBIT = {"1 Gbit/s": 1000.0, "100 Mbit/s": 100.0}
RATIOS = {
    "lightning_ddp": "ds_mirrored / Lightning ddp (target <= 1.00)",
    "plain_ddp": "ds_mirrored / plain DDP loop (target <= 1.10)",
}


class Mirrored(harness.Benchmark):
    name = "mirrored"
    description = __doc__
    defaults = {"repeats": 5, "steps": 150, "warmup": 20}
    quick = {"repeats": 1, "steps": 10, "warmup": 2}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=None, help="timed steps per run (150; 10 with --quick)")
        parser.add_argument("--warmup", type=int, default=None, help="warm-up steps left out (20; 2 with --quick)")
        parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024], help="hidden widths (1024 1024)")
        parser.add_argument("--batch-size", type=int, default=32, help="batch per process (32)")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (600)")

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [Arm(n, p) for n, p in STRATEGIES.items()]
        arms += [
            Arm(c, {"mode": "lightning", "strategy": "ds_mirrored", "compression": c}, f"ds_mirrored {c}")
            for c in COMPRESSIONS
            if c != "none"
        ]
        return Experiment(arms, opts.repeats, baseline="ds_mirrored")

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {**arm.params, "hidden": opts.hidden, "batch_size": opts.batch_size}
        spec.update(steps=opts.steps, warmup=opts.warmup)
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1))
        r = found["result"]
        reading = {"rc": found["rc"], "step_ms": r["median_step_ms"]}
        reading.update({k: r[k] for k in ("comm_bytes_per_step", "uncompressed_bytes_per_step") if k in r})
        return reading

    def progress(self, record: dict[str, Any]) -> str:
        return f"{record['step_ms']:.2f} ms/step"

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        records = data["records"]
        s = harness.summarise(records, list(data["arms"]), ["step_ms", "comm_bytes_per_step"])
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
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        s, st = data["summary"], data["settings"]
        hidden = "-".join(str(h) for h in st["hidden"])
        rows = [[n, fmt(s[n]["step_ms"], ".2f")] for n in STRATEGIES]
        rows += [[f"**{label}**", f"**{fmt(s['ds_mirrored'][f'over_{a}'], '.3f')}**"] for a, label in RATIOS.items()]
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
                    *(f"{p[link]:.1f}" if p[link] else "-" for link in LINKS_MBIT),
                ]
            )
        failed = [f"{a}: {e}" for a, v in s.items() for e in v["errors"]]
        return [
            f"2 CPU processes (gloo, 1 thread each), MLP 64-{hidden}-10, batch {st['batch_size']} per process,"
            f" {st['warmup']} warm-up + {st['steps']} timed steps per run, {st['repeats']} interleaved repeat(s)."
            " Median of per-run medians [min - max]; ratios per repeat.",
            "",
            *harness.markdown_table(["strategy", "step (ms)"], rows),
            "",
            *harness.markdown_table(
                [
                    "gradient_compression",
                    "bytes/step",
                    "vs none",
                    "loopback step (ms)",
                    "projected @1 Gbit/s",
                    "projected @100 Mbit/s",
                ],
                comp_rows,
            ),
            *(["", "Failed runs:", *(f"- {f}" for f in failed)] if failed else []),
        ]

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        s = data["summary"]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        names = [n for n in STRATEGIES if s[n]["step_ms"]]
        med = [s[n]["step_ms"]["median"] for n in names]
        err = [
            [m - s[n]["step_ms"]["min"] for n, m in zip(names, med, strict=True)],
            [s[n]["step_ms"]["max"] - m for n, m in zip(names, med, strict=True)],
        ]
        ax1.bar(names, med, yerr=err, capsize=4, color=["tab:blue", "tab:orange", "tab:gray"][: len(names)])
        ax1.set_ylabel("median step time (ms)")
        ax1.set_title("2 CPU procs (min-max over repeats)")
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
        fig.tight_layout()
        path = out / "mirrored.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return [path]


if __name__ == "__main__":
    harness.main(Mirrored())
