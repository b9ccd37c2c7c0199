"""The link-attribution benchmark's page and files: the markdown from a finished run's JSON (so ``--render`` needs no
cluster), the median slowed launch's report PNG and Chrome trace kept beside it, and that trace drawn as a timeline by
the pipeline's own renderer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.harness import fmt, markdown_table
from benchmarks.harness.figures import save_palette

TRACE = "_trace_slowed"  # "_trace_" in a stem: a trace, not a results file (bench_all.load, the results tests)


def _window(trace: Path, steps: int) -> list[Any]:
    """The spans of ``steps`` steps from the middle of a DistributedReport trace, every rank's."""
    from benchmarks.pipeline.worker import _spans_from_chrome  # the pipeline benchmark's trace reader
    from ds_lightning.pipeline.trace import SpanRecorder

    spans = SpanRecorder.from_payload(_spans_from_chrome(trace))
    every = sorted({s.step for s in spans})
    first = (len(every) - steps) // 2 if len(every) > steps else 0
    chosen = set(every[first : first + steps])
    return [s for s in spans if s.step in chosen]


def keep_files(
    chosen: Mapping[str, Any] | None, kept: dict[tuple[str, int], Path], out: Path, stem: str, trace_steps: int
) -> dict[str, Any]:
    """Keeps the chosen launch's ``report.png`` as ``<stem>_report.png`` (a palette PNG, as every committed chart)
    and ``trace_steps`` steps from the middle of its Chrome trace as ``<stem>_trace_slowed.json`` (the results stay
    small); an older run's files of those names go first, so none is left beside other results. Returns the names
    kept, the launch's repeat and the steps of the trace (empty when no slowed launch succeeded)."""
    from ds_lightning.pipeline.trace import write_chrome_trace

    out.mkdir(parents=True, exist_ok=True)
    for suffix in ("_report.png", f"{TRACE}.json", f"{TRACE}.png"):
        (out / f"{stem}{suffix}").unlink(missing_ok=True)
    folder = kept.get((chosen["arm"], chosen["repeat"])) if chosen is not None else None
    if chosen is None or folder is None:
        return {}
    files: dict[str, Any] = {"repeat": chosen["repeat"]}
    if (folder / "report.png").exists():
        save_palette((folder / "report.png").read_bytes(), out / f"{stem}_report.png")
        files["report_png"] = f"{stem}_report.png"
    if (folder / "trace.json").exists() and (spans := _window(folder / "trace.json", trace_steps)):
        write_chrome_trace(spans, out / f"{stem}{TRACE}.json")
        files["trace_json"] = f"{stem}{TRACE}.json"
        files["trace_steps"] = [min(s.step for s in spans), max(s.step for s in spans)]
    return files


def trace_png(data: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """The kept trace as a timeline PNG, one lane per rank, by the pipeline's renderer; none without a trace."""
    trace = out / f"{stem}{TRACE}.json"
    if not trace.exists():
        return []
    from benchmarks.pipeline.worker import _spans_from_chrome
    from ds_lightning.pipeline.trace import SpanRecorder, render_timeline_png

    st, files = data["settings"], data.get("setup", {}).get("files", {})
    repeat = files["repeat"] + 1 if "repeat" in files else "?"
    first, last = files.get("trace_steps", ("?", "?"))
    title = (
        f"DistributedReport's trace, steps {first}-{last}: host 2's link at {st['slow_mbit']:g} Mbit/s, the others'"
        f" at {st['fast_mbit']:g} (the median slowed launch, repeat {repeat})"
    )
    spans = SpanRecorder.from_payload(_spans_from_chrome(trace))
    return [render_timeline_png(spans, out / f"{stem}{TRACE}.png", title=title)]


def _or(x: float | None, spec: str) -> str:
    return "-" if x is None else f"{x:{spec}}"


def _joined(xs: list[float | None], spec: str, scale: float = 1.0) -> str:
    return " / ".join(_or(None if x is None else x * scale, spec) for x in xs)


def launch_rows(records: list[dict[str, Any]], hosts: list[str]) -> list[list[Any]]:
    """A row per launch, in launch order; a failed one says why."""
    rows = []
    for r in sorted(records, key=lambda r: r["order"]):
        head = [r["repeat"] + 1, r["arm"]]
        if "error" in r:
            rows.append([*head, f"FAILED: {r['error']}", *["-"] * 6])
            continue
        named = "none" if r["slow_host"] is None else f"host {r['named_index']} ({r['slow_host']})"
        if r["slow_host"] is not None and r["named_index"] is None:
            named = f"{r['slow_host']} (not a cluster host)"
        rows.append(
            [
                *head,
                f"{r['step_ms']:.1f}",
                _joined(r["link_ms"], ".0f"),
                _joined(r["rate_mb_s"], ".1f"),
                named,
                r["bound"],
                _joined(r["wire_sent"], ".1f", 1e-6),
                " ".join(map(str, r["exit_codes"])),
            ]
        )
    return rows


def markdown(data: dict[str, Any], labels: dict[str, str], slow_host: int, target: float) -> list[str]:
    s, st, setup = data["summary"], data["settings"], data.get("setup", {})
    hosts = setup.get("hosts", [])
    kinds = {kind for links in setup.get("links", {}).values() for kind in links.get("qdisc", {}).values()}
    where = ", ".join(f"host {i} {a}" for i, a in enumerate(hosts)) or "-"
    lines = [
        "# DistributedReport's attribution of a slow link (network-namespace cluster)",
        "",
        f"{len(hosts)} network-namespace hosts ({where}), one `ds_mirrored` rank each, told the cluster by `TF_CONFIG`"
        f" alone: `ds-train fit` of `examples/configs/mirrored.yaml` with the {data['workload']}, {st['steps']} steps"
        " (the report leaves its first 2 out), no validation, `DistributedReport(every_n_steps=0, trace_path=...)`."
        f" Arms: **equal**, {labels['equal']} ({st['fast_mbit']:g} Mbit/s); **slowed**, {labels['slowed']}"
        f" ({st['slow_mbit']:g} Mbit/s), the others at {st['fast_mbit']:g}. Both directions of a link shaped"
        f" ({', '.join(sorted(kinds)) or '-'}); {st['repeats']} interleaved repeat(s).",
        "",
        "Step: each rank's median step, the median over ranks. Link time: the report's time a step the host's link was"
        " busy (`links.hosts[].link_ms`); rate: its fastest transfer to or from the host (`rate_mb_s`, MB/s, from the"
        " kernel's TCP counters, not a probe). Added and attributed are taken per repeat (slowed minus equal, the"
        " same repeat), and share = attributed / added. Wire out: the bytes each rank's TCP connections sent"
        " (`wire_sent`). [The README](../link_attribution/README.md).",
        "",
        "## Launches",
        "",
    ]
    head = ["repeat", "arm", "step (ms)", "link ms, host 0 / 1 / 2", "rate MB/s, host 0 / 1 / 2", "host named"]
    head += ["bound", "wire out MB, rank 0 / 1 / 2", "exit codes"]
    lines += markdown_table(head, launch_rows(data["records"], hosts))
    rows = [
        ["step, equal links (ms)", fmt(s["equal"]["step_ms"])],
        ["step, host 2 slowed (ms)", fmt(s["slowed"]["step_ms"])],
        ["added step time: slowed - equal (ms)", fmt(s["added_step_ms"])],
        [f"attributed: host {slow_host}'s link time, slowed - equal (ms)", fmt(s["attributed_ms"])],
        [f"share: attributed / added (target >= {target:.2f})", fmt(s["share"], ".2f")],
        [f"host {slow_host}'s rate, slowed (MB/s)", fmt(s["slow_rate_mb_s"], ".2f")],
        ["the slower other host's rate, slowed (MB/s)", fmt(s["other_rate_mb_s"], ".1f")],
        [f"slowed launches naming host {slow_host}", s["named"]],
        ["equal launches naming any host (the control)", s["control_named"]],
    ]
    errors = [*s["equal"]["errors"], *s["slowed"]["errors"]]
    lines += ["", "## Summary", "", "Median [min - max] over launches, or over repeats for the paired figures.", ""]
    lines += markdown_table(["figure", "median [min - max]"], rows)
    if errors:
        lines += ["", f"{len(errors)} launch(es) failed: " + "; ".join(errors)]
    lines += _tables(s, setup.get("files", {}))
    return lines


def _tables(s: dict[str, Any], files: dict[str, Any]) -> list[str]:
    """The two reports as rank 0 printed them, and the kept files."""
    if s["median_repeat"] is None:
        return ["", "No slowed launch succeeded: no report to show."]
    rep = s["median_repeat"] + 1
    lines = ["", f"## The reports of repeat {rep}: the slowed launch at the median step, and its equal pair", ""]
    lines += ["Slowed (host 2's link slow):", "", "```text", *s["slowed_table"].splitlines(), "```", ""]
    equal = s["equal_table"].splitlines() or ["(that repeat's equal launch failed)"]
    lines += ["Equal links (the control):", "", "```text", *equal, "```"]
    shown = []
    if "report_png" in files:
        shown.append(f"[its report.png]({files['report_png']}) (per-rank step time over the steps)")
    if "trace_json" in files:
        json_name, png = files["trace_json"], files["trace_json"].replace(".json", ".png")
        first, last = files["trace_steps"]
        shown.append(f"its Chrome trace of steps {first}-{last} [{json_name}]({json_name}), drawn as [{png}]({png})")
    if shown:
        lines += ["", f"Of the slowed launch: {'; '.join(shown)}."]
    return lines
