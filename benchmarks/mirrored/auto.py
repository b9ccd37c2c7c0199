"""The ``gradient_compression="auto"`` arm, shared by mirrored/ (auto against ``none`` on loopback) and cluster/
(against the best fixed setting per link): what a worker records of auto's choices, and how the reports read it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from benchmarks.harness import fmt, is_met, markdown_table, ok, paired, spread, verdict

AUTO = "auto"
LOOPBACK_TARGET = 1.05  # auto / none step time on loopback
CLUSTER_TARGET = 1.10  # auto / the best fixed setting's step time on a shaped link


def auto_reading(strategy: Any) -> dict[str, Any] | None:
    """Auto's final choice, every decision and the last probe's figures, JSON-ready; ``None`` without auto."""
    auto = getattr(strategy, "auto_compression", None)
    if auto is None:
        return None
    return {
        "choice": auto.choice,
        "steps": auto.step,
        "interval": auto.interval,
        "start_iter": auto.start_iter,
        "decisions": [
            {
                "step": d.step,
                "choice": d.choice,
                "previous": d.previous,
                "probed": d.probed,
                "predicted_ms": {name: 1e3 * s for name, s in d.predicted_s.items()},
                "step_ms": None if d.step_s is None else 1e3 * d.step_s,
            }
            for d in auto.decisions
        ],
        "figures": auto.figures.as_dict() if auto.figures is not None else None,
    }


def timed_choices(reading: dict[str, Any], warmup: int, total: int) -> dict[str, int]:
    """Steps of ``[warmup, total)`` run under each choice: a decision at step ``s`` holds from gradient sync ``s``."""
    decisions = sorted(reading.get("decisions") or [], key=lambda d: d["step"])
    out: Counter[str] = Counter()
    for step in range(warmup, total):
        made = [d["choice"] for d in decisions if d["step"] <= step]
        out[made[-1] if made else reading.get("choice", "?")] += 1
    return dict(out)


def probes_in(reading: dict[str, Any], warmup: int, total: int) -> int:
    """Link probes that fell on the timed steps (the set-up probe, at step 0 before any step, is never one)."""
    return sum(
        1 for d in reading.get("decisions") or [] if d["probed"] and d["step"] > 0 and warmup <= d["step"] < total
    )


def trail(reading: dict[str, Any], limit: int = 6) -> str:
    """The decisions as text: ``step 0: none (probed), step 10: powersgd``; the rest counted past ``limit``."""
    decisions = reading.get("decisions") or []
    shown = [f"step {d['step']}: {d['choice']}{' (probed)' if d['probed'] else ''}" for d in decisions[:limit]]
    if len(decisions) > limit:
        shown.append(f"{len(decisions) - limit} more")
    return ", ".join(shown) or "no decision recorded"


def choices(readings: list[dict[str, Any] | None], warmup: int, total: int) -> dict[str, Any]:
    """Over runs: how often each final choice came out, the timed steps under each choice, the probes in the timed
    steps, the probed link figures (float32 latency and bandwidth, float16 bandwidth) and the first run's trail."""
    got = [r for r in readings if r]
    timed: Counter[str] = Counter()
    for r in got:
        timed.update(timed_choices(r, warmup, total))
    figures = [r["figures"] for r in got if r.get("figures")]
    return {
        "runs": len(got),
        "final": dict(Counter(r["choice"] for r in got)),
        "timed_steps": dict(timed),
        "probes_in_timed_steps": spread([probes_in(r, warmup, total) for r in got]),
        "latency_us": spread([1e6 * f["float32"]["latency_s"] for f in figures]),
        "bandwidth_mb_s": spread([f["float32"]["bandwidth"] / 1e6 for f in figures]),
        "fp16_bandwidth_mb_s": spread([f["float16"]["bandwidth"] / 1e6 for f in figures]),
        "trail": trail(got[0]) if got else None,
    }


def choice_text(c: dict[str, Any] | None) -> str:
    """One line of :func:`choices`: the final choice per run, the timed steps per choice, the link auto measured."""
    if not c or not c["runs"]:
        return "no auto reading"
    final = ", ".join(f"{n} in {k} of {c['runs']} runs" for n, k in sorted(c["final"].items(), key=lambda x: -x[1]))
    timed = ", ".join(f"{n} {k}" for n, k in sorted(c["timed_steps"].items(), key=lambda x: -x[1]))
    return (
        f"chose {final} (timed steps: {timed or '-'}); probed latency {fmt(c['latency_us'], '.0f')} us/round,"
        f" bandwidth {fmt(c['bandwidth_mb_s'], '.0f')} MB/s float32, {fmt(c['fp16_bandwidth_mb_s'], '.0f')} MB/s"
        f" float16; first run's decisions: {c['trail']}"
    )


def loopback_summary(records: list[dict[str, Any]], none_arm: str, warmup: int, steps: int) -> dict[str, Any]:
    """Auto against ``none_arm`` per repeat: the ratio of the runs' median step times (the target's figure) and of
    their mean step times (which count the steps that probed the link), and what auto chose."""
    median = paired(records, AUTO, none_arm, "step_ms")
    return {
        "over_none": median,
        "mean_over_none": paired(records, AUTO, none_arm, "mean_step_ms"),
        "met": is_met(median, at_most=LOOPBACK_TARGET),
        "choices": choices([r.get("auto") for r in ok(records, AUTO)], warmup, warmup + steps),
    }


def loopback_lines(summary: dict[str, Any], none_arm: str, settings: dict[str, Any]) -> list[str]:
    """The report's section on auto: a table of auto against none, then what auto chose."""
    a, n, s = summary[AUTO], summary[none_arm], summary[AUTO]["auto"]
    interval, over = settings.get("auto_interval"), s["over_none"]
    target = [f"**{fmt(over, '.3f')}**", f"<= {LOOPBACK_TARGET:g}", verdict(over, at_most=LOOPBACK_TARGET)]
    rows = [
        ["median step (ms)", *(fmt(v["step_ms"], ".2f") for v in (a, n)), *target],
        ["mean step (ms), probe steps included", *(fmt(v.get("mean_step_ms"), ".2f") for v in (a, n))],
    ]
    rows[1] += [fmt(s["mean_over_none"], ".3f"), "-", "-"]
    failed = f" ({a['failed_runs']} of {a['runs']} auto runs failed)" if a["failed_runs"] else ""
    return [
        "",
        f"**gradient_compression='auto' against none on loopback**{failed}: `MirroredStrategy(gradient_compression="
        f"'auto'{'' if interval is None else f', auto_interval={interval}'})` (the strategy's other defaults), the"
        " same runs as above; ratios per repeat. The set-up probe runs before the first step, outside the step time;"
        f" probes in the timed steps per run: {fmt(s['choices']['probes_in_timed_steps'], '.0f')}.",
        "",
        *markdown_table(["", "auto", "none", "auto / none", "target", "result"], rows),
        "",
        f"What auto chose: {choice_text(s['choices'])}.",
    ]
