"""Part 1 of the cluster benchmark: ds_mirrored's ``gradient_compression`` settings on shaped links, on the digits MLP
or the GPT (``--model``); its configurations, worker spec, per-run reading, rounds, the unshaped accuracy (digits) or
perplexity (GPT) run, the summary and the verdict. ``driver.py`` drives it.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks import harness
from benchmarks.cluster.launch import WORKERS, run_configs, shape_links
from benchmarks.cluster.report import (
    ACC_TOLERANCE_POINTS,
    GPT_LR,
    LR,
    NO_NETEM,
    PPL_TOLERANCE,
    TARGET_LINK,
    TARGET_SPEEDUP,
    links_of,
)
from benchmarks.harness import fmt, markdown_table, round_order, spread
from benchmarks.harness import workloads as _workloads
from benchmarks.mirrored.auto import AUTO
from ds_lightning.testing import netns

#: per-workload defaults of the options left unset: a full run, then what ``--quick`` changes. The GPT run keeps to
#: part 1 (its parts 2 and 3 are measured by parameter_server.py and load_balance.py); its perplexity run trains
#: 200 steps x 2 workers x 8 windows x 128 tokens = 409,600 tokens per setting. The auto arm's PowerSGD rank is the
#: smallest rank the verdict admitted when the fixed settings were measured (digits 4, GPT 16): auto never lowers it.
MODEL_DEFAULTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "digits": (
        {"steps": 5, "warmup": 2, "acc_steps": 60, "batch_size": 32, "powersgd_ranks": [1, 4], "auto_powersgd_rank": 4}
        | {"parts": ["compression", "ps", "balance", "hierarchical"]},
        {"steps": 2, "warmup": 1, "acc_steps": 6},
    ),
    "gpt": (
        {"steps": 10, "warmup": 3, "acc_steps": 200, "batch_size": 8, "powersgd_ranks": [1, 4, 16]}
        | {"auto_powersgd_rank": 16}
        | {"parts": ["compression"]},
        {"steps": 2, "warmup": 1, "acc_steps": 6},
    ),
}


def model_defaults(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill the options still ``None`` from the workload's full (or ``--quick``) defaults."""
    full = {m: {k: list(v) if isinstance(v, list) else v for k, v in d[0].items()} for m, d in MODEL_DEFAULTS.items()}
    return _workloads.fill_defaults(opts, full, {m: d[1] for m, d in MODEL_DEFAULTS.items()})


def is_gpt(opts: argparse.Namespace | dict[str, Any]) -> bool:
    model = opts.get("model") if isinstance(opts, dict) else getattr(opts, "model", None)
    return model == "gpt"


def tokens_per_step(settings: dict[str, Any]) -> int:
    """Tokens of both workers' batches in one step of the GPT."""
    return WORKERS * settings["batch_size"] * settings["gpt_block"]


def compression_configs(opts: argparse.Namespace) -> list[dict[str, Any]]:
    configs: list[dict[str, Any]] = [{"name": c, "compression": c} for c in ("none", "fp16", "bf16")]
    for rank in opts.powersgd_ranks:
        configs.append(
            {
                "name": f"powersgd_r{rank}",
                "compression": "powersgd",
                "powersgd_rank": rank,
                "powersgd_start_iter": opts.powersgd_start_iter,
            }
        )
    rank = getattr(opts, "auto_powersgd_rank", None)
    if rank is not None and rank > 0:  # gradient_compression="auto", interleaved with the fixed settings
        auto = {
            "name": AUTO,
            "compression": AUTO,
            "powersgd_rank": rank,
            "powersgd_start_iter": opts.powersgd_start_iter,
        }
        if getattr(opts, "auto_interval", None) is not None:
            auto["auto_interval"] = opts.auto_interval
        configs.append(auto)
    return configs


def fixed_configs(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fixed settings: every configuration but auto."""
    return [c for c in configs if c["compression"] != AUTO]


def compression_spec(opts: argparse.Namespace, steps: int, warmup: int) -> dict[str, Any]:
    spec = {
        "kind": "compression",
        "hidden": opts.hidden,
        "lr": LR,
        "batch_size": opts.batch_size,
        "seed": 0,
        "dist_timeout": opts.dist_timeout,
        "warmup": warmup,
        "steps": steps,
        "workload": _workloads.spec_of(opts),
    }
    if is_gpt(opts):
        spec.update(lr=GPT_LR, val_windows=opts.val_windows)
    return spec


def compact_runs(data: dict[str, Any]) -> dict[str, Any]:
    """Part 1's runs (timed, and the long accuracy runs) with rank 0's per-step times as quantiles, as runs now keep
    them (:func:`merge_compression`); nothing read from them changes."""
    runs = [r for link in (data.get("raw") or {}).get("compression", {}).values() for rs in link.values() for r in rs]
    runs += [*(data.get("accuracy") or {}).values(), *(data.get("accuracy_auto") or {}).values()]
    for run in runs:
        if isinstance(run.get("step_ms"), list):
            run["step_ms"] = harness.series(run["step_ms"])
    return data


def merge_compression(ranks: dict[int, dict[str, Any]], warmup: int) -> dict[str, Any]:
    r0, r1 = ranks[0], ranks[1]
    metric = "final_ppl" if "final_ppl" in r0 else "final_acc"  # the GPT's perplexity, the digits' accuracy
    return {
        "median_step_ms": statistics.median(r0["step_ms"][warmup:]),
        "median_step_ms_rank1": statistics.median(r1["step_ms"][warmup:]),
        "step_ms": harness.series(r0["step_ms"]),  # every step's, warm-up included, as quantiles
        "bytes_per_step": r0.get("timed_bytes_per_step", r0["comm_bytes_per_step"]),
        "uncompressed_bytes_per_step": r0["uncompressed_bytes_per_step"],
        metric: r0[metric],
        "fit_s": r0["fit_s"],
        "to_first_step_s": r0["to_first_step_s"],
        "params": r0["params"],
        "param_checksum": r0.get("param_checksum"),
        "steps": r0["steps"],
        **({"auto": r0["auto"]} if "auto" in r0 else {}),
    }


def _figure(result: dict[str, Any]) -> str:
    figure = f"ppl {result['final_ppl']:.3f}" if "final_ppl" in result else f"acc {result['final_acc']:.3f}"
    return figure + (f", auto chose {result['auto']['choice']}" if "auto" in result else "")


def run_compression_round(
    cluster: netns.Cluster, r: int, opts: argparse.Namespace, raw: dict[str, Any], setup: dict[str, Any]
) -> None:
    configs = compression_configs(opts)
    spec = compression_spec(opts, opts.steps, opts.warmup)
    for link in round_order([link for link in links_of(opts.model) if link["key"] not in setup["unsupported"]], r):
        key = link["key"]
        rates = {i: (link["rate_mbit"], link["delay_ms"]) for i in range(WORKERS)}
        try:
            shaped = shape_links(cluster, rates)
        except netns.ShapingUnsupportedError as error:
            setup["unsupported"][key] = f"{NO_NETEM} ({error})"
            print(f"  repeat {r + 1} part 1 {link['label']}: {NO_NETEM}", flush=True)
            continue
        setup["links"].setdefault(key, shaped)
        order = round_order(configs, r)
        records, launches = run_configs(cluster, spec, order, opts)
        for config in order:
            name = config["name"]
            rec = records[name]
            result = rec if "error" in rec else merge_compression(rec, opts.warmup)
            raw[key][name].append(result)
            if "error" not in result:
                print(
                    f"  repeat {r + 1} part 1 {link['label']:>11} {name:>12}: {result['median_step_ms']:8.1f} ms/step,"
                    f" {result['bytes_per_step'] / 1e6:7.3f} MB/step, {_figure(result)}",
                    flush=True,
                )
        print(f"    launches: {', '.join(f'{s:.0f} s' for s in launches)}", flush=True)


def run_accuracy(cluster: netns.Cluster, opts: argparse.Namespace) -> dict[str, Any]:
    """Every setting once on the unshaped link, ``--acc-steps`` steps (the first 2 left out of the step time): the
    digits' accuracy, or the GPT's validation perplexity, after the same steps, data and initial parameters."""
    for host in cluster.hosts:
        cluster.unshape(host)
    warmup = min(2, opts.acc_steps - 1)
    spec = compression_spec(opts, opts.acc_steps - warmup, warmup)
    records, _ = run_configs(cluster, spec, fixed_configs(compression_configs(opts)), opts)
    out = {}
    for name, rec in records.items():
        out[name] = rec if "error" in rec else merge_compression(rec, warmup)
        if "error" not in rec:
            figure = (
                f"ppl {out[name]['final_ppl']:.4f}" if "final_ppl" in out[name] else f"acc {out[name]['final_acc']:.4f}"
            )
            print(
                f"  accuracy run {name:>12}: {figure} after {out[name]['steps']} steps,"
                f" unshaped {out[name]['median_step_ms']:.1f} ms/step",
                flush=True,
            )
    return out


def run_auto_accuracy(cluster: netns.Cluster, opts: argparse.Namespace, setup: dict[str, Any]) -> dict[str, Any]:
    """Auto once per shaped link, ``--acc-steps`` steps as in :func:`run_accuracy`: what auto computes depends on the
    link (it picks the compression from it), so its accuracy or perplexity is taken on each link it is timed on."""
    auto = [c for c in compression_configs(opts) if c["compression"] == AUTO]
    if not auto:
        return {}
    warmup = min(2, opts.acc_steps - 1)
    spec = compression_spec(opts, opts.acc_steps - warmup, warmup)
    out: dict[str, Any] = {}
    for link in links_of(opts.model):
        if link["key"] in setup["unsupported"]:
            continue
        try:
            shape_links(cluster, {i: (link["rate_mbit"], link["delay_ms"]) for i in range(WORKERS)})
        except netns.ShapingUnsupportedError:
            continue  # the timed rounds noted it in setup["unsupported"]
        records, _ = run_configs(cluster, spec, auto, opts)
        rec = records[AUTO]
        out[link["key"]] = rec if "error" in rec else merge_compression(rec, warmup)
        if "error" not in rec:
            print(
                f"  accuracy run auto at {link['label']:>11}: {_figure(out[link['key']])} after"
                f" {out[link['key']]['steps']} steps, {out[link['key']]['median_step_ms']:.1f} ms/step",
                flush=True,
            )
    return out


def summarise_compression(raw: dict[str, dict[str, list[dict[str, Any]]]], tokens: int | None = None) -> dict[str, Any]:
    """Per link and setting: spreads over the repeats; ``tokens`` per step (the GPT's) adds ``tokens_per_s`` and reads
    ``final_ppl`` where the digits have ``final_acc``."""
    metric = "final_acc" if tokens is None else "final_ppl"
    out: dict[str, Any] = {}
    for key, configs in raw.items():
        base = configs.get("none", [])
        link: dict[str, Any] = {}
        for name, runs in configs.items():
            ok = [r for r in runs if "error" not in r]
            pairs = [(b, x) for b, x in zip(base, runs, strict=False) if "error" not in b and "error" not in x]
            link[name] = {
                "runs": len(runs),
                "failed_runs": len(runs) - len(ok),
                "errors": [r["error"] for r in runs if "error" in r],
                "step_ms": spread([r["median_step_ms"] for r in ok]),
                "bytes_per_step": spread([r["bytes_per_step"] for r in ok]),
                metric: spread([r[metric] for r in ok]),
                "speedup_over_none": spread([b["median_step_ms"] / x["median_step_ms"] for b, x in pairs]),
            }
            if tokens is not None:
                link[name]["tokens_per_s"] = spread([tokens * 1000 / r["median_step_ms"] for r in ok])
        out[key] = link
    return out


def verdict(comp: dict[str, Any], accuracy: dict[str, Any]) -> dict[str, Any]:
    """The fastest setting at 100 Mbit/s among those whose accuracy after the long run is within
    ``ACC_TOLERANCE_POINTS`` of none's: the target asks for the speedup at equal accuracy."""
    link = comp.get(TARGET_LINK, {})
    base = accuracy.get("none", {}).get("final_acc")
    best, value, excluded = None, None, {}
    for name, v in link.items():
        s = v["speedup_over_none"]
        if name in ("none", AUTO) or s is None:  # auto is judged on its own (cluster/auto_report.py)
            continue
        acc = accuracy.get(name, {}).get("final_acc")
        if base is None or acc is None or 100 * (base - acc) > ACC_TOLERANCE_POINTS:
            excluded[name] = None if base is None or acc is None else round(100 * (acc - base), 1)
            continue
        if value is None or s["median"] > value["median"]:
            best, value = name, s
    return {
        "target": (
            f"step time at 100 Mbit/s: best gradient_compression vs none, among settings within"
            f" {ACC_TOLERANCE_POINTS:g} point of none's accuracy after the same steps"
        ),
        "goal": f">= {TARGET_SPEEDUP:g}x faster",
        "best": best,
        "value": value,
        "excluded_for_accuracy_points": excluded,
        "met": harness.is_met(value, at_least=TARGET_SPEEDUP),
        "verdict": harness.verdict(value, at_least=TARGET_SPEEDUP),
    }


def ppl_verdict(comp: dict[str, Any], perplexity: dict[str, Any], configs: list[dict[str, Any]]) -> dict[str, Any]:
    """The GPT's verdict: only settings whose validation perplexity after the same tokens is within ``PPL_TOLERANCE``
    of none's (ppl <= (1 + tolerance) x none's) count; among them the fastest at 100 Mbit/s against the target. Also
    the smallest PowerSGD rank within the tolerance (None: no rank tried stayed within it)."""
    base = perplexity.get("none", {}).get("final_ppl")

    def ratio(name: str) -> float | None:
        ppl = perplexity.get(name, {}).get("final_ppl")
        return None if base is None or ppl is None else ppl / base

    def within(name: str) -> bool:
        r = ratio(name)
        return r is not None and r <= 1 + PPL_TOLERANCE

    best, value, excluded = None, None, {}
    for name, v in comp.get(TARGET_LINK, {}).items():
        s = v["speedup_over_none"]
        if name in ("none", AUTO) or s is None:  # auto is judged on its own (cluster/auto_report.py)
            continue
        if not within(name):
            r = ratio(name)
            excluded[name] = None if r is None else round(r, 4)
            continue
        if value is None or s["median"] > value["median"]:
            best, value = name, s
    ranks = sorted((c["powersgd_rank"], c["name"]) for c in configs if c["compression"] == "powersgd")
    passing = [rank for rank, name in ranks if within(name)]
    return {
        "target": (
            "step time at 100 Mbit/s: best gradient_compression vs none, among settings whose validation perplexity"
            f" after the same tokens is within {100 * PPL_TOLERANCE:g}% of none's"
        ),
        "goal": f">= {TARGET_SPEEDUP:g}x faster",
        "best": best,
        "value": value,
        "excluded_for_ppl_ratio": excluded,
        "ppl_ratio": {name: ratio(name) for name in perplexity},
        "powersgd_ranks": [rank for rank, _ in ranks],
        "powersgd_rank_within_tolerance": passing[0] if passing else None,
        "met": harness.is_met(value, at_least=TARGET_SPEEDUP),
        "verdict": harness.verdict(value, at_least=TARGET_SPEEDUP),
    }


def gpt_markdown(data: dict[str, Any]) -> list[str]:
    """Part 1's section of the GPT's page (the flat view of ``Cluster.view``): step time, tokens/s, bytes and speedup
    per link, the perplexity after the same tokens, and the verdict counting only settings within the tolerance."""
    comp, ppl = data["compression"], data.get("accuracy") or {}
    names = [c["name"] for c in fixed_configs(data["compression_configs"])]
    links = [link for link in links_of("gpt") if link["key"] in comp]
    tokens = tokens_per_step(data)
    t = data["targets"][0]
    ratios = t.get("ppl_ratio", {})
    lines = [
        "**1. ds_mirrored gradient_compression on shaped links** (2 worker hosts, both links shaped alike;"
        f" {data.get('workload_label', 'GPT')}, {_params(data.get('params'))} parameters, AdamW lr {GPT_LR:g}"
        f" betas (0.9, 0.95) weight decay 0.1; batch {data['batch_size']} windows of {data['gpt_block']} tokens per"
        f" worker = {tokens} tokens per step; {data['warmup']} warm-up + {data['steps']} timed steps per run; step time"
        " = rank 0's median over the timed steps, batch start to batch end; tokens/s = tokens per step / step time;"
        f" powersgd_start_iter={data['powersgd_start_iter']}). Speedup = none's step time / the setting's, per repeat."
        " Perplexity: exp of the mean token cross-entropy of rank 0's final parameters on the first"
        f" {data['val_windows']} windows ({data['val_windows'] * data['gpt_block']} tokens) of TextDataModule's"
        f" validation split, after {data['acc_steps']} steps = {tokens * data['acc_steps']:,} tokens in one extra run"
        " per setting on the unshaped cluster link (same seed, initial parameters and data order; the link changes a"
        " step's duration, not its result).",
        "",
    ]
    head = ["gradient_compression", "MB/step (timed)"]
    for link in links:
        head += [f"{link['label']}: step (ms)", f"{link['label']}: tokens/s", f"{link['label']}: speedup"]
    head += ["unshaped step (ms), 1 run", f"val perplexity after {tokens * data['acc_steps']:,} tokens", "vs none"]
    rows = []
    for name in names:
        mb = next((comp[k][name]["bytes_per_step"] for k in comp if comp[k].get(name, {}).get("bytes_per_step")), None)
        row = [name, "-" if mb is None else f"{mb['median'] / 1e6:.3f}"]
        for link in links:
            v = comp[link["key"]].get(name)
            if v is None or v["step_ms"] is None:
                row += [f"failed ({v['failed_runs']} of {v['runs']})" if v else "-", "-", "-"]
                continue
            failed = f" ({v['failed_runs']} of {v['runs']} failed)" if v["failed_runs"] else ""
            speed = "1" if name == "none" else f"**{fmt(v['speedup_over_none'], '.2f')}x**"
            row += [f"{fmt(v['step_ms'], '.0f')}{failed}", fmt(v.get("tokens_per_s"), ".0f"), speed]
        a = ppl.get(name, {})
        ratio = ratios.get(name)
        row += [
            f"{a['median_step_ms']:.0f}" if "median_step_ms" in a else "failed",
            f"{a['final_ppl']:.3f}" if "final_ppl" in a else "failed",
            "-" if ratio is None else f"{ratio:.4f}x",
        ]
        rows.append(row)
    result = t.get("verdict") or harness.verdict(t["value"], at_least=TARGET_SPEEDUP)
    lines += [
        *markdown_table(head, rows),
        "",
        *markdown_table(
            ["target", "goal", "measured", "result"],
            [[t["target"], t["goal"], f"{t['best'] or '-'}: {fmt(t['value'], '.2f')}x", result]],
        ),
        "",
    ]
    for name, ratio in t.get("excluded_for_ppl_ratio", {}).items():
        why = "its perplexity run failed" if ratio is None else f"its perplexity is {ratio:.4f}x none's"
        lines += [f"{name} is left out of the verdict: {why} (limit {1 + PPL_TOLERANCE:g}x).", ""]
    tried = ", ".join(str(r) for r in t.get("powersgd_ranks", [])) or "none"
    rank = t.get("powersgd_rank_within_tolerance")
    if rank is not None:
        lines += [
            f"Smallest PowerSGD rank within {100 * PPL_TOLERANCE:g}% of none's perplexity: **{rank}** (ranks tried:"
            f" {tried}).",
            "",
        ]
    else:
        lines += [
            f"No PowerSGD rank tried ({tried}) stayed within {100 * PPL_TOLERANCE:g}% of none's perplexity after the"
            " same tokens.",
            "",
        ]
    return lines


def _params(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.2f}M"
