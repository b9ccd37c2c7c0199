"""Part 1 of the cluster benchmark: ``gradient_compression`` on shaped links, and ``"auto"`` against the best fixed
setting. See README.md."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks import harness
from benchmarks.cluster import report
from benchmarks.cluster.launch import run_configs, shape_links
from benchmarks.cluster.report import WORKERS, links_of
from benchmarks.harness import round_order, spread
from benchmarks.harness import workloads as _workloads
from benchmarks.mirrored.auto import AUTO, CLUSTER_TARGET, choices, timed_choices
from ds_lightning.testing import netns

#: per workload: a full run's defaults of the options left unset, then what ``--quick`` changes. The auto arm's
#: PowerSGD rank is the smallest the verdict admitted when the fixed settings were measured: auto never lowers it.
MODEL_DEFAULTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "digits": (
        {"steps": 3, "warmup": 2, "acc_steps": 60, "batch_size": 32, "powersgd_ranks": [4], "auto_powersgd_rank": 4}
        | {"parts": ["compression", "ps", "balance", "hierarchical"]},
        {"steps": 2, "warmup": 1, "acc_steps": 6},
    ),
    "gpt": (
        {"steps": 6, "warmup": 2, "acc_steps": 150, "batch_size": 8, "powersgd_ranks": [4, 16]}
        | {"auto_powersgd_rank": 16, "parts": ["compression"]},
        {"steps": 2, "warmup": 1, "acc_steps": 6},
    ),
}


def model_defaults(opts: argparse.Namespace) -> argparse.Namespace:
    full = {m: {k: list(v) if isinstance(v, list) else v for k, v in d[0].items()} for m, d in MODEL_DEFAULTS.items()}
    return _workloads.fill_defaults(opts, full, {m: d[1] for m, d in MODEL_DEFAULTS.items()})


def _shaped(cluster: netns.Cluster, link: dict[str, Any]) -> dict[str, Any]:
    return shape_links(cluster, {i: (link["rate_mbit"], link["delay_ms"]) for i in range(WORKERS)})


def compression_configs(opts: argparse.Namespace) -> list[dict[str, Any]]:
    configs: list[dict[str, Any]] = [{"name": c, "compression": c} for c in ("none", "fp16", "bf16")]
    start = {"powersgd_start_iter": opts.powersgd_start_iter}
    for rank in opts.powersgd_ranks:
        configs.append({"name": f"powersgd_r{rank}", "compression": "powersgd", "powersgd_rank": rank, **start})
    rank = getattr(opts, "auto_powersgd_rank", None)
    if rank:  # gradient_compression="auto", interleaved with the fixed settings
        auto = {"name": AUTO, "compression": AUTO, "powersgd_rank": rank, **start}
        if getattr(opts, "auto_interval", None) is not None:
            auto["auto_interval"] = opts.auto_interval
        configs.append(auto)
    return configs


def compression_spec(opts: argparse.Namespace, steps: int, warmup: int) -> dict[str, Any]:
    gpt = opts.model == "gpt"
    spec = {
        "kind": "compression",
        "hidden": opts.hidden,
        "lr": report.GPT_LR if gpt else report.LR,
        "batch_size": opts.batch_size,
    }
    spec |= {"seed": 0, "dist_timeout": opts.dist_timeout, "warmup": warmup, "steps": steps}
    return spec | {"workload": _workloads.spec_of(opts)} | ({"val_windows": opts.val_windows} if gpt else {})


def merge_compression(ranks: dict[int, dict[str, Any]], warmup: int) -> dict[str, Any]:
    r0, r1 = ranks[0], ranks[1]
    metric = "final_ppl" if "final_ppl" in r0 else "final_acc"
    return {
        "median_step_ms": statistics.median(r0["step_ms"][warmup:]),
        "median_step_ms_rank1": statistics.median(r1["step_ms"][warmup:]),
        "step_ms": harness.series(r0["step_ms"]),  # every step's, warm-up included, as quantiles
        "bytes_per_step": r0.get("timed_bytes_per_step", r0["comm_bytes_per_step"]),
        "uncompressed_bytes_per_step": r0["uncompressed_bytes_per_step"],
        metric: r0[metric],
        **{k: r0.get(k) for k in ("fit_s", "to_first_step_s", "params", "param_checksum", "steps")},
        **({"auto": r0["auto"]} if "auto" in r0 else {}),
    }


def _run(
    cluster: netns.Cluster, spec: dict[str, Any], configs: list[dict[str, Any]], opts: argparse.Namespace
) -> dict[str, Any]:
    records = run_configs(cluster, spec, configs, opts)
    return {n: rec if "error" in rec else merge_compression(rec, spec["warmup"]) for n, rec in records.items()}


def run_compression_round(
    cluster: netns.Cluster, r: int, opts: argparse.Namespace, raw: dict[str, Any], setup: dict[str, Any]
) -> None:
    """Every configuration once per link, in one launch per link; the order rotates by repeat."""
    spec = compression_spec(opts, opts.steps, opts.warmup)
    for link in round_order([link for link in links_of(opts.model) if link["key"] not in setup["unsupported"]], r):
        try:
            setup["links"].setdefault(link["key"], _shaped(cluster, link))
        except netns.ShapingUnsupportedError as error:
            setup["unsupported"][link["key"]] = f"{report.NO_NETEM} ({error})"
            continue
        for name, result in _run(cluster, spec, round_order(compression_configs(opts), r), opts).items():
            raw[link["key"]][name].append(result)


def run_accuracy(
    cluster: netns.Cluster, opts: argparse.Namespace, setup: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--acc-steps`` steps per setting on the unshaped link (the link changes a step's duration, not its result),
    and auto's on each shaped link it was timed on (what auto computes depends on the link it measures)."""
    shape_links(cluster, {})
    warmup = min(2, opts.acc_steps - 1)
    spec = compression_spec(opts, opts.acc_steps - warmup, warmup)
    configs = compression_configs(opts)
    fixed = _run(cluster, spec, [c for c in configs if c["compression"] != AUTO], opts)
    auto: dict[str, Any] = {}
    for link in links_of(opts.model) if any(c["compression"] == AUTO for c in configs) else []:
        if link["key"] not in setup["unsupported"]:
            _shaped(cluster, link)
            auto[link["key"]] = _run(cluster, spec, configs[-1:], opts)[AUTO]
    return fixed, auto


def spreads(runs: list[dict[str, Any]], keys: dict[str, Any]) -> dict[str, Any]:
    """``failed_runs``, ``errors`` and a spread per key over the runs that did not fail (``keys``: name -> reader)."""
    ok = [r for r in runs if "error" not in r]
    out = {"failed_runs": len(runs) - len(ok), "errors": [r["error"] for r in runs if "error" in r]}
    return out | {k: spread([read(r) for r in ok]) for k, read in keys.items()}


def paired_runs(
    runs: list[dict[str, Any]], base: list[dict[str, Any]], key: str, op: Any = lambda x, y: x / y
) -> dict[str, Any] | None:
    """Spread of ``op(run, base)`` over the repeats where neither failed."""
    return spread(
        [op(x[key], y[key]) for x, y in zip(runs, base, strict=False) if "error" not in x and "error" not in y]
    )


def summarise_compression(raw: dict[str, dict[str, list[dict[str, Any]]]], tokens: int | None = None) -> dict[str, Any]:
    """Per link and setting: spreads over the repeats, the speed-up over none per repeat; ``tokens`` per step (the
    GPT's) adds ``tokens_per_s`` and reads ``final_ppl`` where the digits have ``final_acc``."""
    metric = "final_acc" if tokens is None else "final_ppl"
    keys = {k: lambda r, k=k: r[k] for k in ("bytes_per_step", metric)} | {"step_ms": lambda r: r["median_step_ms"]}
    if tokens is not None:
        keys["tokens_per_s"] = lambda r: tokens * 1000 / r["median_step_ms"]
    return {
        key: {
            name: {"runs": len(runs), **spreads(runs, keys)}
            | {"speedup_over_none": paired_runs(runs, configs.get("none", []), "median_step_ms", lambda x, b: b / x)}
            for name, runs in configs.items()
        }
        for key, configs in raw.items()
    }


def _within(value: float | None, base: float | None, gpt: bool) -> bool | None:
    """Whether a final accuracy or perplexity is within the verdict's bounds of none's (``None``: no figure)."""
    if value is None or base is None:
        return None
    return value / base <= 1 + report.PPL_TOLERANCE if gpt else 100 * (base - value) <= report.ACC_TOLERANCE_POINTS


def verdict(comp: dict[str, Any], accuracy: dict[str, Any], configs: list[dict[str, Any]], gpt: bool) -> dict[str, Any]:
    """The fastest fixed setting at 100 Mbit/s among those within the accuracy (digits: 1 point) or perplexity (GPT:
    2%) bounds of none's after the same steps, against the 5x target; the GPT adds the smallest PowerSGD rank within."""
    metric = "final_ppl" if gpt else "final_acc"
    base = accuracy.get("none", {}).get(metric)
    best, value, excluded = None, None, {}
    for name, v in comp.get(report.TARGET_LINK, {}).items():
        if name in ("none", AUTO) or v["speedup_over_none"] is None:  # auto has its own targets
            continue
        mine = accuracy.get(name, {}).get(metric)
        if not _within(mine, base, gpt):
            excess = None if mine is None or base is None else mine / base if gpt else 100 * (mine - base)
            excluded[name] = None if excess is None else round(excess, 4 if gpt else 1)
        elif value is None or v["speedup_over_none"]["median"] > value["median"]:
            best, value = name, v["speedup_over_none"]
    bound = (
        f"whose validation perplexity after the same tokens is within {100 * report.PPL_TOLERANCE:g}% of none's"
        if gpt
        else f"within {report.ACC_TOLERANCE_POINTS:g} point of none's accuracy after the same steps"
    )
    out = {
        "target": f"step time at 100 Mbit/s: best gradient_compression vs none, among settings {bound}",
        "goal": f">= {report.TARGET_SPEEDUP:g}x faster",
        "best": best,
        "value": value,
        f"excluded_for_{'ppl_ratio' if gpt else 'accuracy_points'}": excluded,
        "met": harness.is_met(value, at_least=report.TARGET_SPEEDUP),
        "verdict": harness.verdict(value, at_least=report.TARGET_SPEEDUP),
    }
    if gpt:
        ranks = sorted((c["powersgd_rank"], c["name"]) for c in configs if c["compression"] == "powersgd")
        passing = [rank for rank, name in ranks if _within(accuracy.get(name, {}).get(metric), base, gpt)]
        out["ppl_ratio"] = {
            n: None if base is None or "final_ppl" not in a else a["final_ppl"] / base for n, a in accuracy.items()
        }
        out["powersgd_ranks"] = [rank for rank, _ in ranks]
        out["powersgd_rank_within_tolerance"] = passing[0] if passing else None
    return out


def summarise_auto(
    comp: dict[str, Any],
    raw: dict[str, Any],
    accuracy: dict[str, Any],
    accuracy_auto: dict[str, Any],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """Per measured link: auto / the best fixed setting within the verdict's bounds (none always counts) and / the
    fastest of all, per repeat; auto's accuracy or perplexity on that link against none's; what auto chose."""
    gpt = settings.get("model") == "gpt"
    metric = "final_ppl" if gpt else "final_acc"
    base = accuracy.get("none", {}).get(metric)
    out: dict[str, Any] = {}
    for key, link in comp.items():
        runs = raw.get(key, {})
        if not runs.get(AUTO):  # a link not measured (no netem for its delay)
            continue
        medians = {n: v["step_ms"]["median"] for n, v in link.items() if n != AUTO and v.get("step_ms") is not None}
        admitted = {
            n: m for n, m in medians.items() if n == "none" or _within(accuracy.get(n, {}).get(metric), base, gpt)
        }
        best = min(admitted, key=admitted.__getitem__) if admitted else None
        fastest = min(medians, key=medians.__getitem__) if medians else None
        over_best = paired_runs(runs[AUTO], runs[best], "median_step_ms") if best else None
        ok = [r for r in runs[AUTO] if "error" not in r]
        long = accuracy_auto.get(key, {})
        speed_met, acc_met = harness.is_met(over_best, at_most=CLUSTER_TARGET), _within(long.get(metric), base, gpt)
        out[key] = {
            "step_ms": link[AUTO]["step_ms"],
            "failed_runs": link[AUTO]["failed_runs"],
            "runs": link[AUTO]["runs"],
            "best": best,
            "best_step_ms": link[best]["step_ms"] if best else None,
            "over_best": over_best,
            "fastest": fastest,
            "over_fastest": paired_runs(runs[AUTO], runs[fastest], "median_step_ms") if fastest else None,
            "speed_met": speed_met,
            metric: long.get(metric),
            f"none_{metric}": base,
            "accuracy_met": acc_met,
            "accuracy_error": long.get("error"),
            "met": None if speed_met is None or acc_met is None else speed_met and acc_met,
            "choices": choices([r.get("auto") for r in ok], settings["warmup"], settings["warmup"] + settings["steps"]),
            "long_run": {
                "steps": long.get("steps"),
                "step_ms": long.get("median_step_ms"),
                "timed_steps": timed_choices(long["auto"], 0, long["steps"]) if "auto" in long else None,
                "choice": long["auto"]["choice"] if "auto" in long else None,
            },
        }
    return out


def summarise_part1(data: dict[str, Any]) -> dict[str, Any]:
    """Part 1's summary (``compression`` None when it did not run), its 5x ``targets`` and, with the arm, ``auto``."""
    settings, raw = data["settings"], data["raw"]["compression"]
    if "compression" not in settings["parts"]:
        return {"compression": None, "targets": []}
    gpt = settings.get("model") == "gpt"
    comp = summarise_compression(raw, WORKERS * settings["batch_size"] * settings["gpt_block"] if gpt else None)
    accuracy, configs = data.get("accuracy") or {}, data["compression_configs"]
    out = {"compression": comp, "targets": [verdict(comp, accuracy, configs, gpt)]}
    if any(c["compression"] == AUTO for c in configs):
        out["auto"] = summarise_auto(comp, raw, accuracy, data.get("accuracy_auto") or {}, settings)
    return out


def part1_verdicts(targets: list[dict[str, Any]], auto: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The 5x target; per link, auto / best per repeat, which must also keep the accuracy or perplexity in bounds."""
    best = [
        harness.judged(
            f"{t['target']} (best: {t['best'] or '-'})", t["value"], at_least=report.TARGET_SPEEDUP, unit="x"
        )
        for t in targets
    ]
    return best + [
        harness.judged(
            f"auto / best fixed setting step time at {report.LABELS.get(key, key)}, its"
            f" {'perplexity' if 'final_ppl' in v else 'accuracy'} within the bounds",
            v["over_best"],
            at_most=CLUSTER_TARGET,
            unit="x",
            holds=v["accuracy_met"],
        )
        for key, v in (auto or {}).items()
    ]
