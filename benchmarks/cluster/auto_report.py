"""Part 1 of the cluster benchmark, ``gradient_compression="auto"``: its step time at each shaped link against the best
fixed setting there, its accuracy (digits) or perplexity (GPT) against the compression verdict's bounds, and what it
chose. ``driver.py`` calls :func:`summarise_auto` and :func:`auto_markdown`; the runs are part 1's rounds
(auto interleaved with the fixed settings) and ``compression.run_auto_accuracy`` (one long run per link).

The best fixed setting at a link is the fastest there (median over the repeats) among the settings the verdict admits:
accuracy within ``ACC_TOLERANCE_POINTS`` of none's (digits), or perplexity at most ``1 + PPL_TOLERANCE`` times none's
(GPT), after the same steps; ``none`` always counts. The ratio auto / best is taken per repeat.
"""

from __future__ import annotations

from typing import Any

from benchmarks import harness
from benchmarks.cluster.report import ACC_TOLERANCE_POINTS, LINKS, PPL_TOLERANCE
from benchmarks.harness import fmt, markdown_table, spread
from benchmarks.mirrored.auto import AUTO, CLUSTER_TARGET, choice_text, choices, timed_choices


def _bound(gpt: bool) -> str:
    return (
        f"perplexity <= {1 + PPL_TOLERANCE:g}x none's"
        if gpt
        else f"accuracy >= none's - {ACC_TOLERANCE_POINTS:g} point"
    )


def _within(value: float | None, base: float | None, gpt: bool) -> bool | None:
    """Whether a final accuracy or perplexity is within the verdict's bounds of none's (``None``: no figure)."""
    if value is None or base is None:
        return None
    return value / base <= 1 + PPL_TOLERANCE if gpt else 100 * (base - value) <= ACC_TOLERANCE_POINTS


def _per_repeat(auto: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any] | None:
    pairs = [(a, b) for a, b in zip(auto, other, strict=False) if "error" not in a and "error" not in b]
    return spread([a["median_step_ms"] / b["median_step_ms"] for a, b in pairs])


def summarise_auto(
    comp: dict[str, Any],
    raw: dict[str, dict[str, list[dict[str, Any]]]],
    accuracy: dict[str, Any],
    accuracy_auto: dict[str, Any],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """Per measured link: auto's step time, the best fixed setting (within the verdict's bounds) and the fastest of
    all, auto / each per repeat against ``CLUSTER_TARGET``, auto's accuracy or perplexity after ``acc_steps`` on that
    link against none's, and what auto chose in the timed runs and in the long run."""
    gpt = settings.get("model") == "gpt"
    metric = "final_ppl" if gpt else "final_acc"
    base = accuracy.get("none", {}).get(metric)
    warmup, total = settings["warmup"], settings["warmup"] + settings["steps"]
    out: dict[str, Any] = {}
    for key, link in comp.items():
        runs = raw.get(key, {})
        auto_runs = runs.get(AUTO, [])
        if not auto_runs:  # a link not measured (no netem for its delay)
            continue
        medians = {n: v["step_ms"]["median"] for n, v in link.items() if n != AUTO and v.get("step_ms") is not None}
        admitted = {
            n: m for n, m in medians.items() if n == "none" or _within(accuracy.get(n, {}).get(metric), base, gpt)
        }
        best = min(admitted, key=admitted.__getitem__) if admitted else None
        fastest = min(medians, key=medians.__getitem__) if medians else None
        over_best = _per_repeat(auto_runs, runs[best]) if best else None
        long = accuracy_auto.get(key, {})
        value = long.get(metric)
        speed_met = harness.is_met(over_best, at_most=CLUSTER_TARGET)
        acc_met = _within(value, base, gpt)
        out[key] = {
            "step_ms": link[AUTO]["step_ms"],
            "failed_runs": link[AUTO]["failed_runs"],
            "runs": link[AUTO]["runs"],
            "best": best,
            "best_step_ms": link[best]["step_ms"] if best else None,
            "over_best": over_best,
            "fastest": fastest,
            "over_fastest": _per_repeat(auto_runs, runs[fastest]) if fastest else None,
            "speed_met": speed_met,
            metric: value,
            f"none_{metric}": base,
            "accuracy_met": acc_met,
            "accuracy_error": long.get("error"),
            "met": None if speed_met is None or acc_met is None else speed_met and acc_met,
            "choices": choices([r.get("auto") for r in auto_runs if "error" not in r], warmup, total),
            "long_run": {
                "steps": long.get("steps"),
                "step_ms": long.get("median_step_ms"),
                "timed_steps": timed_choices(long["auto"], 0, long["steps"]) if "auto" in long else None,
                "choice": long["auto"]["choice"] if "auto" in long else None,
            },
        }
    return out


def auto_verdicts(summary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per measured link, the target as ``summary["verdicts"]`` lists it: auto / best per repeat, which must also
    keep the accuracy or perplexity within the verdict's bounds (one long run: a condition, not a spread)."""
    labels = {link["key"]: link["label"] for link in LINKS}
    out = []
    for key, v in (summary or {}).items():
        figure = "perplexity" if "final_ppl" in v else "accuracy"
        out.append(
            harness.judged(
                f"auto / best fixed setting step time at {labels.get(key, key)}, its {figure} within the bounds",
                v["over_best"],
                at_most=CLUSTER_TARGET,
                unit="x",
                holds=v["accuracy_met"],
            )
        )
    return out


def _result(v: dict[str, Any]) -> str:
    """The step-time verdict (the harness's rule) and, when it is met, whether the accuracy or perplexity held."""
    speed = harness.verdict(v["over_best"], at_most=CLUSTER_TARGET)
    figure = "perplexity" if "final_ppl" in v else "accuracy"
    if speed != "met":
        return f"{speed} (step time)" if speed in ("within noise", "missed") else speed
    return {True: "met", False: f"missed ({figure})", None: f"no {figure}"}[v["accuracy_met"]]


def _figure(v: dict[str, Any]) -> str:
    if "final_ppl" in v:
        value, base = v["final_ppl"], v["none_final_ppl"]
        if value is None:
            return "failed" if v["accuracy_error"] else "-"
        return f"{value:.3f} ({value / base:.4f}x none's)" if base else f"{value:.3f}"
    value, base = v["final_acc"], v["none_final_acc"]
    if value is None:
        return "failed" if v["accuracy_error"] else "-"
    return f"{100 * value:.1f} ({100 * (value - base):+.1f} points)" if base is not None else f"{100 * value:.1f}"


def auto_markdown(data: dict[str, Any]) -> list[str]:
    """Part 1's auto section, from the flat view of ``Cluster.view``; empty for results without the auto arm."""
    summary = data.get("auto")
    if not summary:
        return []
    gpt = data.get("model") == "gpt"
    config = next((c for c in data["compression_configs"] if c["name"] == AUTO), {})
    interval = config.get("auto_interval")
    what = "validation perplexity" if gpt else "validation accuracy"
    labels = {link["key"]: link["label"] for link in LINKS}
    rows = []
    for key, v in summary.items():
        failed = f" ({v['failed_runs']} of {v['runs']} failed)" if v["failed_runs"] else ""
        rows.append(
            [
                labels.get(key, key),
                f"{fmt(v['step_ms'], '.0f')}{failed}",
                f"{v['best'] or '-'}: {fmt(v['best_step_ms'], '.0f')}",
                f"**{fmt(v['over_best'], '.3f')}**",
                f"{v['fastest'] or '-'}: {fmt(v['over_fastest'], '.3f')}",
                _figure(v),
                _result(v),
            ]
        )
    lines = [
        f"**1b. gradient_compression='auto' on the same links** (`MirroredStrategy(gradient_compression='auto',"
        f" powersgd_rank={config.get('powersgd_rank')}, powersgd_start_iter={config.get('powersgd_start_iter')}"
        f"{'' if interval is None else f', auto_interval={interval}'})`: PowerSGD, when chosen, at the smallest rank"
        " the verdict admitted when the fixed settings were measured; auto's runs interleaved with the fixed settings'"
        " above, same steps). Best fixed = the fastest setting at that link among those within the verdict's bounds"
        f" ({_bound(gpt)} after the same steps; none always counts); auto / best and auto / the fastest of all, per"
        f" repeat. Target: auto / best <= {CLUSTER_TARGET:.2f} with auto's {what} within the same bounds. Auto's"
        f" {what}: one extra run of {data['acc_steps']} steps on each shaped link (what auto"
        " computes depends on the link it measures), against none's after the same steps (unshaped run above).",
        "",
        *markdown_table(
            [
                "link",
                "auto step (ms)",
                "best fixed: step (ms)",
                f"auto / best (target <= {CLUSTER_TARGET:.2f})",
                "fastest fixed: auto / it",
                f"auto's {what}{'' if gpt else ' (%)'} after {data['acc_steps']} steps",
                "result",
            ],
            rows,
        ),
        "",
    ]
    for key, v in summary.items():
        long = v["long_run"]
        under = ", ".join(f"{n} {k}" for n, k in (long["timed_steps"] or {}).items())
        lines += [
            f"- {labels.get(key, key)}: {choice_text(v['choices'])}."
            + (f" Long run: {under} steps, {long['step_ms']:.0f} ms/step." if under and long["step_ms"] else ""),
        ]
    return [*lines, ""]
