"""The straggler benchmark's arms, targets and chart (``driver.py`` measures and reports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import workloads as _workloads
from benchmarks.harness.figures import save_figure

WORKERS = 2
TARGET_ASYNC_SPEEDUP = 1.5  # async samples/s over ds_mirrored's, under the straggler
TARGET_ACC_POINTS = 2.0  # final accuracy within this many points of ds_mirrored's
TARGET_PPL_RATIO = 1.05  # GPT: final validation perplexity at most this times ds_mirrored's
TARGET_BSP_STEP = 1.3  # max_staleness=0 step time over ds_mirrored's, no straggler
PHASES = ("sleep", "before_step", "step_backward", "after_backward")  # as the worker splits a step
MIRRORED = "ds_mirrored"
ASYNC = "ps_async"
BSP = "ps_staleness_0"
NO = "no_straggler/"  # the prefix of the arms without a straggler
STRAGGLER: dict[str, dict[str, Any]] = {
    MIRRORED: {"strategy": "ds_mirrored"},
    BSP: {"strategy": "ds_parameter_server", "max_staleness": 0},
    "ps_staleness_4": {"strategy": "ds_parameter_server", "max_staleness": 4},
    ASYNC: {"strategy": "ds_parameter_server", "max_staleness": None},
}
NO_STRAGGLER = {NO + MIRRORED: STRAGGLER[MIRRORED], NO + BSP: STRAGGLER[BSP]}
LABELS = {
    MIRRORED: "ds_mirrored",
    BSP: "ds_parameter_server max_staleness=0",
    "ps_staleness_4": "ds_parameter_server max_staleness=4",
    ASYNC: "ds_parameter_server max_staleness=None",
}


def unit(settings: dict[str, Any]) -> tuple[str, int]:
    """What throughput counts and how many of it a sample holds: samples (digits) or tokens (the GPT's context)."""
    if settings.get("model", "digits") == "gpt":
        return "tokens", int(settings.get("gpt_block", _workloads.GPT_DEFAULTS["block_size"]))
    return "samples", 1


def group(summary: dict[str, Any], arms: dict[str, Any]) -> dict[str, Any]:
    """The summary of ``arms`` (straggler or not), keyed by the configuration's name."""
    return {a.removeprefix(NO): summary[a] for a in arms if a in summary}


def plot(data: dict[str, Any], path: Path) -> None:
    """Accuracy (perplexity on the GPT) against samples, throughput with the straggler, step time without."""
    import matplotlib  # here: running the benchmark needs no matplotlib until it writes

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, n = group(data["summary"], STRAGGLER), group(data["summary"], NO_STRAGGLER)
    slowdown = data["settings"]["slowdown"]
    what, per_sample = unit(data["settings"])
    gpt = what == "tokens"
    scale = 1.0 if gpt else 100.0  # perplexity as it is, accuracy in %
    colors = dict(zip(STRAGGLER, ["tab:blue", "tab:orange", "tab:green", "tab:red"], strict=True))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [2.2, 1.4, 0.8]})
    for name in STRAGGLER:
        for i, run in enumerate(harness.ok(data["records"], name)):
            xs, ys = zip(*run["curve"], strict=True)
            xs = tuple(x * per_sample for x in xs)
            style = "--" if name == BSP else "-"  # ds_mirrored's numerics: the two curves coincide
            ax1.plot(
                xs, [scale * y for y in ys], style, color=colors[name], alpha=0.75, lw=1.2, label=None if i else name
            )
            final = run.get("final_ppl" if gpt else "final_acc")
            if final is not None:
                ax1.plot(run["samples"] * per_sample, scale * final, "o", color=colors[name], ms=4)
    figure = "validation perplexity" if gpt else "validation accuracy (%)"
    ax1.set_xlabel(f"training {what} seen (all workers)")
    ax1.set_ylabel(f"{figure}, rank 0's parameters")
    if gpt:
        ax1.set_yscale("log")  # from 256 (uniform bytes) down to tens
    else:
        ax1.set_ylim(50, 100)
    ax1.set_title(f"with a {slowdown:g}x straggler: {figure} vs {what} (every repeat; dot = final)")
    ax1.legend(fontsize=8, loc="upper right" if gpt else "lower right")
    ax1.grid(alpha=0.3)
    names = [k for k in s if s[k]["samples_per_s"]]
    med = [s[k]["samples_per_s"]["median"] * per_sample for k in names]
    err = [
        [m - s[k]["samples_per_s"]["min"] * per_sample for k, m in zip(names, med, strict=True)],
        [s[k]["samples_per_s"]["max"] * per_sample - m for k, m in zip(names, med, strict=True)],
    ]
    ax2.bar(range(len(names)), med, yerr=err, capsize=4, color=[colors[k] for k in names])
    for i, k in enumerate(names):
        ratio = s[k].get("samples_per_s_ratio")
        if ratio:
            ax2.annotate(
                f"{ratio['median']:.2f}x",
                (i, s[k]["samples_per_s"]["max"] * per_sample),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax2.set_xticks(range(len(names)), [k.replace("_", "\n", 2) for k in names], fontsize=7)
    ax2.set_ylabel(f"{what}/s (median, min-max)")
    base = s.get(MIRRORED, {}).get("samples_per_s")
    if base:
        ax2.axhline(
            TARGET_ASYNC_SPEEDUP * base["median"] * per_sample, color="k", ls=":", lw=1, label="target for async"
        )
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
        ratio = n[k].get("step_ms_w0_ratio")
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
    save_figure(fig, path)
