"""The faults benchmark's markdown report and chart (``driver.py`` measures; this writes it up)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import fmt
from benchmarks.harness.figures import save_figure

TARGET = 1.05  # async backups every 50 steps: at most 5% on step time
TARGET_EVERY = 50
OVERHEAD_KEYS = ["mean_step_ms", "median_step_ms", "max_step_ms", "mean_over_median", "save_ms", "write_ms"]
RECOVERY_KEYS = [
    "recovery_s",
    "detect_s",
    "relaunch_s",
    "imports_s",
    "startup_s",
    "restore_s",
    "first_step_s",
    "kill_step",
    "resumed_step",
    "steps_lost",
    "since_backup",
]


def report(data: dict[str, Any]) -> list[str]:
    s, st, params = data["summary"]["arms"], data["settings"], data["arm_params"]
    out = [
        f"Commit {data['package']['commit'][:10]}; {data.get('machine', {}).get('cores')} cores, load average"
        f" {_load(data.get('loadavg_start'))} at the start and {_load(data.get('loadavg_end'))} at the end (the"
        " machine is shared: other jobs ran beside this one, so single runs are noisy; read the medians and the"
        f" per-repeat spread). {st['repeats']} interleaved repeat(s); median [min - max] over repeats.",
    ]
    over = [a for a in data["arms"] if params[a]["part"] == "overhead"]
    if over:
        out += [
            "",
            f"### Backup overhead (ds_mirrored, 2 processes, batch {st['batch_size']} per process,"
            f" {st['warmup']} warm-up + {st['steps']} timed steps or one backup period if longer, backups under"
            f" {data.get('backup_root')})",
            "",
            "Step time is the mean from one step's end to the next, so it includes every backup's blocking part."
            " *vs none*: the mean over the mean without backups in the same repeat. *in-run*: the same from"
            " within each run, (mean / median) over the no-backup run's (mean / median): the median is the usual"
            " step, and load that drifts between runs moves this figure much less. *per backup*: (mean - mean"
            " without) x period. *loop wait*: rank 0's time inside BackupAndRestore.save (state copy, and the"
            " file write when sync); *write*: the file write (torch.save, fsync, rename), in a thread when async."
            " *from timings*: 1 + loop wait / (period x usual step without backups), and, for async, up to"
            " 1 + (loop wait + write) / (the same): the upper end if the writing thread took its whole time from"
            " training (on 2 shared cores it competes with it).",
            "",
        ]
        rows = []
        for arm in over:
            p, v = params[arm], s[arm]
            b = p["backup"]
            rows.append(
                [
                    f"{p['model']} ({_params(data, arm)})",
                    "none" if b is None else ("async" if b["async"] else "sync"),
                    "-" if b is None else b["every"],
                    fmt(v["mean_step_ms"], ".2f"),
                    fmt(v.get("overhead_ratio"), ".3f"),
                    fmt(v.get("inrun_ratio"), ".3f"),
                    _fmt_bounds(v.get("bounds")),
                    fmt(v.get("per_backup_ms"), ".0f"),
                    fmt(v.get("save_ms"), ".0f"),
                    fmt(v.get("write_ms"), ".0f"),
                    fmt(v["median_step_ms"], ".2f"),
                    fmt(v["max_step_ms"], ".0f"),
                ]
            )
        out += harness.markdown_table(
            [
                "model",
                "save",
                "every",
                "mean step (ms)",
                "vs none",
                "in-run",
                "from timings",
                "per backup (ms)",
                "loop wait (ms)",
                "write (ms)",
                "median step (ms)",
                "longest step (ms)",
            ],
            rows,
        )
        out.append("")
        for model, t in sorted(data["summary"]["target"].items()):
            if t["ratio"] is None:
                continue
            verdict = harness.verdict(t["ratio"], at_most=TARGET)
            inrun = harness.verdict(t.get("inrun_ratio"), at_most=TARGET)
            out.append(
                f"- **Target (async every {TARGET_EVERY} steps <= {TARGET:.2f}x), {model}: {fmt(t['ratio'], '.3f')}"
                f" -> {verdict}** (in-run estimate {fmt(t.get('inrun_ratio'), '.3f')}: {inrun}; from timings"
                f" {_fmt_bounds(t.get('bounds'))})."
            )
    rec = [a for a in data["arms"] if params[a]["part"] == "recovery"]
    if rec:
        out += [
            "",
            f"### Recovery (kill -9 of every process, of rank 1 alone, or of every process on one host of the"
            " network-namespace cluster, at a step; then the same command again; backups every"
            f" {st['recovery_every']} steps, async; MLP 64-1024-1024-10, 2 training processes)",
            "",
            "Recovery = kill to the end of the first new step = relaunch + imports (rank 0's torch, Lightning,"
            " ds_lightning) + start-up (the other ranks' launch and imports, rendezvous: to the setup hook)"
            " + restore (to on_train_start: the backup read and put back, with the strategy's set-up) + first"
            " step. Detect: from the kill of rank 1 (or of the host) to rank 0's failure (it is part of the relaunch)."
            " In the cluster (netns) each process is one TF_CONFIG task on its own host; the host lost is"
            " ds_mirrored's second worker, ds_pipeline's second stage, and ds_parameter_server's server (a chief"
            " and a worker train on two other hosts). Steps lost ="
            " steps done before the kill that the re-run does again; since backup = the kill step modulo the"
            " period.",
            "",
        ]
        rows = [
            [
                data["arms"][arm],
                *(fmt(s[arm][k], ".2f") for k in RECOVERY_KEYS[:7]),
                *(fmt(s[arm][k], ".0f") for k in RECOVERY_KEYS[7:]),
            ]
            for arm in rec
        ]
        out += harness.markdown_table(
            [
                "strategy",
                "recovery (s)",
                "detect (s)",
                "relaunch (s)",
                "imports (s)",
                "start-up (s)",
                "restore (s)",
                "first step (s)",
                "killed at",
                "resumed from",
                "steps lost",
                "since backup",
            ],
            rows,
        )
    failed = [f"{a}: {e}" for a, v in s.items() for e in v["errors"]]
    return out + (["", "Failed runs:", *(f"- {f}" for f in failed)] if failed else [])


def plot(data: dict[str, Any], out: Path, stem: str = "faults") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, params = data["summary"]["arms"], data["arm_params"]
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(17, 4.5))
    over = [a for a in data["arms"] if params[a]["part"] == "overhead" and params[a]["backup"]]
    for ax, key, ylabel in (
        (ax0, "overhead_ratio", "mean step / no backup's (same repeat)"),
        (ax1, "inrun_ratio", "in-run: (mean/median) / no backup's"),
    ):
        series: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for arm in over:
            p = params[arm]
            if s[arm].get(key):
                label = f"{p['model']} {'async' if p['backup']['async'] else 'sync'}"
                series.setdefault(label, []).append((p["backup"]["every"], s[arm][key]))
        for i, (label, pts) in enumerate(sorted(series.items())):
            pts.sort(key=lambda x: x[0])
            med = [r["median"] for _, r in pts]
            err = [
                [m - r["min"] for m, (_, r) in zip(med, pts, strict=True)],
                [r["max"] - m for m, (_, r) in zip(med, pts, strict=True)],
            ]
            style = "-" if "async" in label else "--"
            xs = [e for e, _ in pts]
            ax.errorbar(xs, med, yerr=err, fmt="o" + style, capsize=3, label=label, color=f"C{i // 2}")
        if series:
            ax.axhline(TARGET, color="red", lw=0.8, ls=":", label=f"target {TARGET:.2f}x at every {TARGET_EVERY}")
            ax.set_xscale("log")
            ax.legend(fontsize=8)
        ax.set_xlabel("backup every n steps")
        ax.set_ylabel(ylabel)
    ax0.set_title("BackupAndRestore overhead, A/B (ds_mirrored, 2 procs)")
    ax1.set_title("BackupAndRestore overhead, within each run")
    rec = [a for a in data["arms"] if params[a]["part"] == "recovery" and s[a].get("recovery_s")]
    bottom = [0.0] * len(rec)
    for k, label in zip(RECOVERY_KEYS[2:7], ["relaunch", "imports", "start-up", "restore", "first step"], strict=True):
        vals = [s[a][k]["median"] if s[a][k] else 0.0 for a in rec]
        ax2.bar(range(len(rec)), vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, a in enumerate(rec):
        ax2.annotate(
            f"{fmt(s[a]['steps_lost'], '.0f').split(' ')[0]} steps lost",
            (i, bottom[i]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax2.set_xticks(range(len(rec)), [data["arms"][a].replace(", ", ",\n") for a in rec], fontsize=8)
    ax2.set_ylabel("seconds from kill -9 (medians)")
    ax2.set_title("Recovery: kill to the first new step")
    if rec:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{stem}.png"
    save_figure(fig, path)
    return [path]


def _fmt_bounds(b: Sequence[float] | None) -> str:
    if not b:
        return "-"
    return f"{b[0]:.3f}" if b[1] == b[0] else f"{b[0]:.3f} - {b[1]:.3f}"


def _load(avg: Sequence[float] | None) -> str:
    return "/".join(f"{x:.1f}" for x in avg) if avg else "?"


def _params(data: dict[str, Any], arm: str) -> str:
    n = next((r["params"] for r in harness.ok(data["records"], arm)), None)
    return f"{n / 1e6:.1f}M params" if n else "?"
