"""The memory benchmark's page and chart, rendered from the JSON's summary (``--render`` redoes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import Panel, fmt
from benchmarks.sharding_engines import common

from .ladder import RUNGS, tied_gpt_parameters
from .modes import MODES, mode_of

__all__ = ["figure", "page"]

DESCRIPTIONS = {
    "plain": "plain",
    "zero": "with `shard_optimizer_state=True` (`sharding_engine='zero'`: ZeRO-1)",
    "fsdp2": "with `shard_optimizer_state=True, sharding_engine='fsdp2'` (no resharding)",
    "zero3": "with `shard_parameters=True` (ZeRO-3 on fsdp2, resharding after forward)",
    "offload": "with `shard_parameters=True, cpu_offload=True`",
    "lightning_fsdp": "`FSDPStrategy` (FULL_SHARD)",
    "deepspeed": "`DeepSpeedStrategy` (stage 3)",
}

COLUMNS = ["arm", "parameters (MB)", "gradients (MB)", "optimizer state per rank (MB, rank 0 / 1 / ...)"]
COLUMNS += ["model state (MB)", "activations (MB)", "peak RSS (MB)", "step (ms)", "step / plain"]
PAYLOAD_COLUMNS = ["arm", "gradient all-reduce (MB/step/rank)", "parameter broadcast (MB/step, largest rank)"]
PAYLOAD_COLUMNS += ["FSDP2 all-gather + reduce-scatter (MB/step, largest rank)"]
PAYLOAD_COLUMNS += ["payload (MB/step, largest rank, counted)", "ring model (MB/step, largest rank)"]
NOTES = [
    "- Per rank, read after the last step by every rank from its own tensors (`ds_lightning.sharding.zero3."
    "local_state_bytes`: local shards of DTensors; optimizer state by `ds_lightning.sharding.optimizer_state_bytes`);"
    " the columns give the largest rank's. Model state = parameters + gradients + optimizer state.",
    "- Activations: the peak bytes autograd saves for backward in one timed step, counted with saved-tensor hooks"
    " (parameters and their views left out: gathered weights count as parameters; a tensor saved twice counts once).",
    "- Peak RSS: each rank's `ru_maxrss` at the end of training (Python, torch, Lightning and the data included).",
    "- Payload bytes are **counted from the collectives' payloads, not measured on a wire**; ZeRO-3 gathers every"
    " unit twice a step (forward and backward). What each column counts: [the README](../memory/README.md).",
]


def _first(s: dict[str, Any], arm: str) -> dict[str, Any]:
    return s.get(arm, {}).get("first") or {}


def mode_rows(data: dict[str, Any]) -> list[list[str]]:
    s = data["summary"]
    rows = []
    for arm, title in data["arms"].items():
        v = s[arm]
        if not v.get("first"):
            continue
        rows.append(
            [
                title,
                fmt(v["param_mb_max"], ".3f"),
                fmt(v["grad_local_mb_max"], ".3f"),
                common.rank_state(v["first"]),
                fmt(v["model_state_mb_max"], ".3f"),
                fmt(v["activation_mb_max"], ".2f"),
                fmt(v["rss_mb_max"], ".0f"),
                fmt(v["step_ms"], ".2f"),
                fmt(v.get("step_ms_ratio"), ".2f"),
            ]
        )
    return rows


def could_not_run(data: dict[str, Any]) -> list[str]:
    """Every arm without a single successful run, with its error (Lightning's own strategies on this CPU)."""
    s = data["summary"]
    out = []
    for arm, title in data["arms"].items():
        if not s[arm].get("first") and s[arm]["errors"]:
            err = s[arm]["errors"][0].removeprefix("not run again: ")
            out.append(f"- **{title}** could not run here: `{err}`")
    return out


def checkpoint_lines(data: dict[str, Any]) -> list[str]:
    s, st = data["summary"].get("checkpoint", {}), data["settings"]
    arms = list(data.get("checkpoint_arms", {}))
    if "checkpoint" not in st["parts"] or not arms:
        return []
    params = next((s[a]["parameters"] for a in arms if s[a].get("parameters")), None)
    head = [
        "",
        "## Checkpoint saves (ZeRO-3, a larger model)",
        "",
        "`MirroredStrategy(shard_parameters=True, state_dict_type='sharded')` on a larger model of the same kind"
        f" ({f'{params:,}' if params else '?'} parameters: "
        + (
            "TiedGPT, d_model 512, 8 layers, AdamW"
            if st.get("model") == "gpt"
            else "the MLP with hidden 4096-4096, Adam"
        )
        + "; one warm-up and one timed step), then `trainer.save_checkpoint` sharded"
        " (torch.distributed.checkpoint, every rank writes its part), then full (gathered, rank 0 writes one file; the"
        " strategy's `state_dict_type` set to `'full'` between the saves). Rank 0's growth is its resident set's peak"
        " during the save (`VmHWM`, reset first) less its resident set before it; the model is the parameters +"
        " optimizer state over every rank (what a checkpoint holds). A larger model than the modes' so that a save's"
        " fixed cost (DCP's plan and metadata, `meta.pt`, a few MB) is small beside 1/N of the model.",
        "",
    ]
    notes = sorted({n for a in arms for n in s[a].get("checkpoint_notes", [])})
    if any("not available yet" in n for n in notes):
        return [*head, *(f"- {n}" for n in notes)]
    rows = []
    for arm in arms:
        v = s[arm]
        for kind in ("sharded", "full"):
            rows.append(
                [
                    data["checkpoint_arms"][arm],
                    kind,
                    fmt(v.get("ckpt_model_mb"), ".1f"),
                    fmt(v.get(f"ckpt_{kind}_s"), ".3f"),
                    fmt(v.get(f"ckpt_{kind}_growth_mb"), ".2f"),
                    fmt(v.get(f"ckpt_{kind}_growth_ratio"), ".2f"),
                    fmt(v.get(f"ckpt_{kind}_disk_mb"), ".1f"),
                ]
            )
    cols = ["arm", "save", "model (MB)", "save time (s, rank 0)", "rank-0 growth (MB)", "growth / (model / N)"]
    return [*head, *harness.markdown_table([*cols, "on disk (MB)"], rows), *(f"- {n}" for n in notes)]


def ladder_lines(data: dict[str, Any]) -> list[str]:
    st, s = data["settings"], data["summary"]
    if "ladder" not in st["parts"]:
        return []
    head = [
        "",
        "## The largest TiedGPT under a per-process cap",
        "",
        f"Each rank in its own cgroup (v1 memory controller) limited to {st['cap_mb']} MiB (a **per-process** cap);"
        " one launch per mode and repeat climbs the ladder, a rung's TiedGPT trained"
        f" {st['ladder_steps']} step(s) (batch 1 x {st['ladder_block']} tokens per rank, AdamW) in the same processes,"
        f" from rung {st['ladder_start']} on, until a rank is OOM-killed (that rung does not fit) or the ladder ends;"
        f" plain and ZeRO-3 climb {st['ladder_repeats']} time(s) interleaved, the other modes once."
        f" Every launch runs with `MALLOC_MMAP_THRESHOLD_={st['mmap_threshold']}` (see the README)."
        " Ladder (d_model / layers): "
        + ", ".join(f"{d}/{n} ({tied_gpt_parameters(d, n, st['ladder_block']) / 1e6:.1f}M)" for d, n in RUNGS)
        + ".",
        "",
    ]
    if data.get("cgroup_unavailable"):
        return [*head, f"Not run: {data['cgroup_unavailable']}."]
    rows = []
    for arm, title in data.get("ladder_arms", {}).items():
        v = s["ladder"][arm]
        stops = "; ".join(f"{c['largest_shape']}, then {c['stopped']}" for c in v.get("climbs", []))
        rows.append(
            [
                title,
                fmt(v["largest_mparams"], ".1f"),
                fmt(v.get("largest_parameters_ratio"), ".2f"),
                fmt(v["largest_peak_rss_mb"], ".0f"),
                fmt(v["climb_s"], ".0f"),
                stops or "; ".join(v["errors"]),
            ]
        )
    cols = ["mode", "largest trained (M parameters)", "/ plain", "its peak RSS (MB, largest rank)", "climb (s)"]
    return [*head, *harness.markdown_table([*cols, "per launch: largest, then why it stopped"], rows)]


def page(data: dict[str, Any]) -> list[str]:
    s, st = data["summary"], data["settings"]
    ran = {mode_of(a) for a in data["arms"]}
    modes = [DESCRIPTIONS[m] for m in MODES if m in ran and not MODES[m].external]
    external = [DESCRIPTIONS[m] for m in MODES if m in ran and MODES[m].external]
    gpt = " The GPT is TiedGPT's network (a ModuleList, a tied head)." if data["workload"]["model"] == "gpt" else ""
    lines = [
        f"# Sharding modes on the {data['workload_label']}",
        "",
        f"`ds_mirrored` {', '.join(modes)}"
        + (f", beside Lightning's {' and '.join(external)}" if external else "")
        + f" on {' and '.join(str(n) for n in st['procs'])} CPU processes (gloo, 1 thread each);"
        + (common.setup_line(data) if data["arms"] else "")
        + gpt
        + " Median [min - max] over launches; each ratio is mode / plain of the same process count and launch.",
    ]
    if data["arms"]:
        lines += ["", *harness.markdown_table(COLUMNS, mode_rows(data)), "", *NOTES]
        payload = [
            [title]
            + [fmt(s[a][k], ".3f") for k in ("grad_mb", "broadcast_mb_max", "fsdp_mb_max")]
            + [fmt(s[a][k], ".3f") for k in ("sent_mb_max", "ring_mb_max")]
            for a, title in data["arms"].items()
            if s[a].get("first") and not MODES[mode_of(a)].external
        ]
        lines += ["", "Payloads per step (counted):", "", *harness.markdown_table(PAYLOAD_COLUMNS, payload)]
        missing = could_not_run(data)
        lines += ["", "Lightning's own strategies where they could not run:", "", *missing] if missing else []
        lines += [
            "",
            *harness.markdown_table(
                ["target", "processes", "mode / plain", "limit", "verdict"],
                [[t["what"], t["procs"], *common.target_cells(t)] for t in s["targets"]],
            ),
        ]
    lines += checkpoint_lines(data) + ladder_lines(data)
    done = {a: t for a, t in data["arms"].items() if s[a].get("first")}  # the others are listed above, with why
    return lines + common.failed({**data, "arms": done, "summary": {a: s[a] for a in done}})


def figure(data: dict[str, Any], path: Path) -> list[Path]:
    """Model state, peak RSS and step time per arm; with the ladder, its largest model per mode."""
    s = data["summary"]
    bars = {a: s[a] for a in data["arms"] if s[a].get("first")}
    panels = [
        Panel("model_state_mb_max", "model state, largest rank (MB)", "model_state_mb_max_ratio"),
        Panel("rss_mb_max", "peak RSS, largest rank (MB)", "rss_mb_max_ratio"),
        Panel("step_ms", "median step (ms)", "step_ms_ratio"),
    ]
    if data.get("ladder_arms"):
        bars.update({a: s["ladder"][a] for a in data["ladder_arms"]})
        panels.append(
            Panel(
                "largest_mparams",
                f"largest TiedGPT under {data['settings']['cap_mb']} MiB (M)",
                "largest_parameters_ratio",
            )
        )
    if not bars:
        return []
    colors = {a: f"C{list(MODES).index(mode_of(a.removeprefix('ladder_')))}" for a in bars}
    title = f"Sharding modes on the {data['workload_label']} (min-max over launches)"
    harness.bar_panels(path, bars, panels, title, colors)
    return [path]
