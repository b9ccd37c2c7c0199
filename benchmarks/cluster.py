"""Benchmarks on shaped links of a real multi-host cluster made of network namespaces, every task driven by TF_CONFIG.

Builds its own cluster of 3 hosts (``ds_lightning.testing.netns.Cluster``: namespaces on one bridge, needs root and
iproute2; it skips with the missing requirement otherwise) and runs every task as its own process on its own host,
configured by ``TF_CONFIG`` alone: no ``MASTER_ADDR``/``MASTER_PORT``, and ``GLOO_SOCKET_IFNAME`` is never set here (the
pack picks the interface holding each task's address). Hosts 0 and 1 are the two workers; host 2 holds the parameter
server. Links are shaped with ``Cluster.shape`` (both directions of a host's link; ``tbf`` rate limiting on kernels
without ``netem``, where a delay cannot be emulated). Every process runs 1 thread.

1. **gradient_compression on slow links.** ds_mirrored on 2 worker hosts, the digits classifier widened to about 10M
   parameters (64-2240-2240-2240-10), batch 32 per worker, both workers' links shaped to 1 Gbit/s, then 100 Mbit/s
   (and the same with 1 ms delay, measured only where the kernel has netem). Settings none, fp16, bf16 and powersgd at
   ``--powersgd-ranks``; ``powersgd_start_iter`` is ``--powersgd-start-iter`` (1: only the first warm-up step is a
   plain all-reduce, every timed step is compressed). Step time = rank 0's median over the timed steps; speedup =
   none / setting per repeat. Target: at 100 Mbit/s the best setting is >= 5x faster than none. Accuracy: rank 0's
   validation accuracy after the timed runs' steps, and after ``--acc-steps`` steps in one extra run per setting on
   the unshaped cluster link (the link changes how long a step takes, not what it computes).
2. **ds_parameter_server vs ds_mirrored on an uneven link.** Worker 0's link at 1 Gbit/s, worker 1's at 100 Mbit/s,
   the server's unshaped; 64-1024-1024-10 (1.1M parameters), batch 32 per worker, equal samples: ds_mirrored runs
   ``--ps-steps`` steps per worker, ds_parameter_server (``--ps-staleness``, default fully asynchronous) gets an update
   budget of the same samples. Samples/s = samples of both workers / (last step end - first step start).
3. **DynamicLoadBalancer vs the equal split on the same uneven link.** ds_mirrored, 64-1024-1024-10, global batch
   ``--global-batch``, ``DynamicLoadBalancer(interval=0)`` (equal split) against ``interval=--interval``; rank 0's
   epoch time (median over the timed epochs). The balancer times compute, not the wire.

Configurations are interleaved repeat by repeat (each repeat: part 1 on every link, then parts 2 and 3; within a
launch the configurations run one after the other in one process per task, the order rotating by repeat), repeated
``--repeats`` times; the tables give medians, per-repeat ratios and the min-max spread. Every launch has a time limit
per configuration: a configuration that fails or hangs is recorded as failed and the launch's remaining
configurations are started again without it. The cluster is always torn down.

The launching and link plumbing is in ``_cluster_launch.py``; the command line is the benchmark harness's.

    python benchmarks/cluster.py [--quick] [--repeats 3] [--out DIR] [--render [JSON]] [--steps 5] [--warmup 2]
                                 [--acc-steps 60]
                                 [--powersgd-ranks 1 4] [--powersgd-start-iter 1] [--ps-steps 50]
                                 [--ps-staleness none] [--balance-epochs 5] [--balance-warmup-epochs 3]
                                 [--global-batch 512] [--interval 3] [--parts compression ps balance]
                                 [--timeout 240] [--dist-timeout 120]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness
from benchmarks._cluster_launch import LAUNCHES, WORKERS, probe_link, rotated, run_configs, shape_links
from benchmarks.harness import spread
from benchmarks.load_balance import reading as balance_reading
from ds_lightning.testing import netns

BATCH = 32
LR = 0.05
TARGET_SPEEDUP = 5.0  # best compression vs none at 100 Mbit/s
ACC_TOLERANCE_POINTS = 1.0  # "equal accuracy": validation accuracy after the long run, in points
NO_NETEM = "not measured: this kernel has no netem"
# Part 1's links: both workers' links shaped alike.
LINKS: list[dict[str, Any]] = [
    {"key": "1gbit", "label": "1 Gbit/s", "rate_mbit": 1000.0, "delay_ms": None},
    {"key": "100mbit", "label": "100 Mbit/s", "rate_mbit": 100.0, "delay_ms": None},
    {"key": "1gbit_1ms", "label": "1 Gbit/s + 1 ms delay", "rate_mbit": 1000.0, "delay_ms": 1.0},
    {"key": "100mbit_1ms", "label": "100 Mbit/s + 1 ms delay", "rate_mbit": 100.0, "delay_ms": 1.0},
]
TARGET_LINK = "100mbit"
# Parts 2 and 3: worker 0's link 10x faster than worker 1's; the server's link unshaped.
UNEVEN_MBIT = (1000.0, 100.0)
MIRRORED = "ds_mirrored"
EQUAL = "equal"
BALANCED = "balanced"

# --- part 1: gradient_compression ------------------------------------------------------------------------------------


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
    return configs


def compression_spec(opts: argparse.Namespace, steps: int, warmup: int) -> dict[str, Any]:
    return {
        "kind": "compression",
        "hidden": opts.hidden,
        "lr": LR,
        "batch_size": BATCH,
        "seed": 0,
        "dist_timeout": opts.dist_timeout,
        "warmup": warmup,
        "steps": steps,
    }


def merge_compression(ranks: dict[int, dict[str, Any]], warmup: int) -> dict[str, Any]:
    r0, r1 = ranks[0], ranks[1]
    return {
        "median_step_ms": statistics.median(r0["step_ms"][warmup:]),
        "median_step_ms_rank1": statistics.median(r1["step_ms"][warmup:]),
        "step_ms": r0["step_ms"],
        "bytes_per_step": r0.get("timed_bytes_per_step", r0["comm_bytes_per_step"]),
        "uncompressed_bytes_per_step": r0["uncompressed_bytes_per_step"],
        "final_acc": r0["final_acc"],
        "fit_s": r0["fit_s"],
        "to_first_step_s": r0["to_first_step_s"],
        "params": r0["params"],
        "param_checksum": r0.get("param_checksum"),
        "steps": r0["steps"],
    }


def run_compression_round(
    cluster: netns.Cluster, r: int, opts: argparse.Namespace, raw: dict[str, Any], setup: dict[str, Any]
) -> None:
    configs = compression_configs(opts)
    spec = compression_spec(opts, opts.steps, opts.warmup)
    for link in rotated([link for link in LINKS if link["key"] not in setup["unsupported"]], r):
        key = link["key"]
        rates = {i: (link["rate_mbit"], link["delay_ms"]) for i in range(WORKERS)}
        try:
            shaped = shape_links(cluster, rates)
        except netns.ShapingUnsupportedError as error:
            setup["unsupported"][key] = f"{NO_NETEM} ({error})"
            print(f"  repeat {r + 1} part 1 {link['label']}: {NO_NETEM}", flush=True)
            continue
        setup["links"].setdefault(key, shaped)
        order = rotated(configs, r)
        records, launches = run_configs(cluster, spec, order, opts)
        for config in order:
            name = config["name"]
            rec = records[name]
            result = rec if "error" in rec else merge_compression(rec, opts.warmup)
            raw[key][name].append(result)
            if "error" not in result:
                print(
                    f"  repeat {r + 1} part 1 {link['label']:>11} {name:>12}: {result['median_step_ms']:8.1f} ms/step,"
                    f" {result['bytes_per_step'] / 1e6:7.3f} MB/step, acc {result['final_acc']:.3f}",
                    flush=True,
                )
        print(f"    launches: {', '.join(f'{s:.0f} s' for s in launches)}", flush=True)


def run_accuracy(cluster: netns.Cluster, opts: argparse.Namespace) -> dict[str, Any]:
    """Every setting once on the unshaped link, ``--acc-steps`` steps (the first 2 left out of the step time)."""
    for host in cluster.hosts:
        cluster.unshape(host)
    warmup = min(2, opts.acc_steps - 1)
    spec = compression_spec(opts, opts.acc_steps - warmup, warmup)
    records, _ = run_configs(cluster, spec, compression_configs(opts), opts)
    out = {}
    for name, rec in records.items():
        out[name] = rec if "error" in rec else merge_compression(rec, warmup)
        if "error" not in rec:
            print(
                f"  accuracy run {name:>12}: acc {out[name]['final_acc']:.4f} after {out[name]['steps']} steps,"
                f" unshaped {out[name]['median_step_ms']:.1f} ms/step",
                flush=True,
            )
    return out


def summarise_compression(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
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
                "final_acc": spread([r["final_acc"] for r in ok]),
                "speedup_over_none": spread([b["median_step_ms"] / x["median_step_ms"] for b, x in pairs]),
            }
        out[key] = link
    return out


# --- parts 2 and 3: the uneven link -----------------------------------------------------------------------------------


def ps_configs(opts: argparse.Namespace) -> list[dict[str, Any]]:
    configs: list[dict[str, Any]] = [{"name": MIRRORED, "strategy": "ds_mirrored"}]
    for staleness in opts.ps_staleness:
        label = "async" if staleness is None else f"staleness_{staleness}"
        configs.append({"name": f"ps_{label}", "strategy": "ds_parameter_server", "max_staleness": staleness})
    return configs


def merge_ps(ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    samples = sum(r["samples"] for r in ranks.values())
    wall = max(r["last_end"] for r in ranks.values()) - min(r["first_start"] for r in ranks.values())
    return {
        "samples": samples,
        "train_s": wall,
        "samples_per_s": samples / wall,
        "steps": [ranks[r]["steps"] for r in sorted(ranks)],
        "step_ms": [statistics.median(ranks[r]["step_ms"][1:] or ranks[r]["step_ms"]) for r in sorted(ranks)],
        "final_acc": ranks[0]["final_acc"],
        "params": ranks[0]["params"],
    }


def merge_balance(ranks: dict[int, dict[str, Any]], warmup_epochs: int) -> dict[str, Any]:
    """The same figures as ``make bench-balance`` takes from its ranks' records (the records have the same form)."""
    r = balance_reading({"rc": None, "result.0": ranks[0], "result.1": ranks[1]}, warmup_epochs)
    r["compute_ms_per_sample"] = [r.pop("compute_ms_per_sample_r0"), r.pop("compute_ms_per_sample_r1")]
    r["median_epoch_s"], r["median_step_ms"], r["epoch_s"] = r.pop("epoch_s"), r.pop("step_ms"), r.pop("epochs")
    r["step_ms"], r["sizes"] = r.pop("step_ms_trace"), r.pop("sizes_trace")  # rank 0's, per step, for the chart
    return {k: v for k, v in r.items() if k != "rc"}


def run_uneven_round(
    cluster: netns.Cluster, r: int, opts: argparse.Namespace, raw: dict[str, Any], setup: dict[str, Any]
) -> None:
    shaped = shape_links(cluster, {i: (UNEVEN_MBIT[i], None) for i in range(WORKERS)})
    setup["links"].setdefault("uneven", shaped)
    base = {"hidden": opts.ps_hidden, "lr": LR, "seed": 0, "dist_timeout": opts.dist_timeout, "workers": WORKERS}
    if "ps" in opts.parts:
        for config in rotated(ps_configs(opts), r):
            spec = {**base, "kind": "ps", "batch_size": BATCH, "steps": opts.ps_steps}
            spec["with_ps"] = config["strategy"] == "ds_parameter_server"
            records, launches = run_configs(cluster, spec, [config], opts)
            rec = records[config["name"]]
            result = rec if "error" in rec else merge_ps(rec)
            raw["ps"][config["name"]].append(result)
            if "error" not in result:
                print(
                    f"  repeat {r + 1} part 2 {config['name']:>18}: {result['samples_per_s']:7.1f} samples/s,"
                    f" steps {result['steps']}, median step {result['step_ms'][0]:.0f}/{result['step_ms'][1]:.0f} ms,"
                    f" acc {result['final_acc']:.3f} ({launches[0]:.0f} s launch)",
                    flush=True,
                )
    if "balance" in opts.parts:
        configs = [{"name": EQUAL, "interval": 0}, {"name": BALANCED, "interval": opts.interval}]
        spec = {
            **base,
            "kind": "balance",
            "batch_size": opts.global_batch // WORKERS,
            "global_batch_size": opts.global_batch,
            "epochs": opts.balance_warmup_epochs + opts.balance_epochs,
        }
        records, launches = run_configs(cluster, spec, rotated(configs, r), opts)
        for config in configs:
            rec = records[config["name"]]
            result = rec if "error" in rec else merge_balance(rec, opts.balance_warmup_epochs)
            raw["balance"][config["name"]].append(result)
            if "error" not in result:
                print(
                    f"  repeat {r + 1} part 3 {config['name']:>18}: epoch {result['median_epoch_s']:.2f} s, step"
                    f" {result['median_step_ms']:.0f} ms, final sizes {result['final_sizes']}, compute/sample"
                    f" {result['compute_ms_per_sample'][0]:.3f}/{result['compute_ms_per_sample'][1]:.3f} ms,"
                    f" acc {result['final_acc']:.3f}",
                    flush=True,
                )
        print(f"    launches: {', '.join(f'{s:.0f} s' for s in launches)}", flush=True)


def paired(runs: list[dict[str, Any]], base: list[dict[str, Any]], key: str, op: Any) -> dict[str, Any] | None:
    ok = [(x, y) for x, y in zip(runs, base, strict=False) if "error" not in x and "error" not in y]
    return spread([op(x[key], y[key]) for x, y in ok])


def summarise_ps(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = raw.get(MIRRORED, [])
    out = {}
    for name, runs in raw.items():
        ok = [r for r in runs if "error" not in r]
        entry: dict[str, Any] = {
            "failed_runs": len(runs) - len(ok),
            "errors": [r["error"] for r in runs if "error" in r],
            "samples_per_s": spread([r["samples_per_s"] for r in ok]),
            "samples": spread([r["samples"] for r in ok]),
            "train_s": spread([r["train_s"] for r in ok]),
            "final_acc": spread([r["final_acc"] for r in ok]),
            "steps_w0": spread([r["steps"][0] for r in ok]),
            "steps_w1": spread([r["steps"][1] for r in ok]),
            "step_ms_w0": spread([r["step_ms"][0] for r in ok]),
            "step_ms_w1": spread([r["step_ms"][1] for r in ok]),
        }
        if name != MIRRORED:
            entry["throughput_over_mirrored"] = paired(runs, base, "samples_per_s", lambda x, y: x / y)
            entry["acc_points_vs_mirrored"] = paired(runs, base, "final_acc", lambda x, y: 100 * (x - y))
        out[name] = entry
    return out


def summarise_balance(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, runs in raw.items():
        ok = [r for r in runs if "error" not in r]
        out[name] = {
            "failed_runs": len(runs) - len(ok),
            "errors": [r["error"] for r in runs if "error" in r],
            "epoch_s": spread([r["median_epoch_s"] for r in ok]),
            "step_ms": spread([r["median_step_ms"] for r in ok]),
            "compute_ms_per_sample_r0": spread([r["compute_ms_per_sample"][0] for r in ok]),
            "compute_ms_per_sample_r1": spread([r["compute_ms_per_sample"][1] for r in ok]),
            "final_share_rank0": spread([r["final_share_rank0"] for r in ok]),
            "final_sizes": [r["final_sizes"] for r in ok],
            "final_acc": spread([r["final_acc"] for r in ok]),
        }
    out["ratio_epoch"] = paired(raw.get(BALANCED, []), raw.get(EQUAL, []), "median_epoch_s", lambda x, y: x / y)
    out["ratio_step"] = paired(raw.get(BALANCED, []), raw.get(EQUAL, []), "median_step_ms", lambda x, y: x / y)
    return out


# --- verdict and output -----------------------------------------------------------------------------------------------


def verdict(comp: dict[str, Any], accuracy: dict[str, Any]) -> dict[str, Any]:
    """The fastest setting at 100 Mbit/s among those whose accuracy after the long run is within
    ``ACC_TOLERANCE_POINTS`` of none's: the target asks for the speedup at equal accuracy."""
    link = comp.get(TARGET_LINK, {})
    base = accuracy.get("none", {}).get("final_acc")
    best, value, excluded = None, None, {}
    for name, v in link.items():
        s = v["speedup_over_none"]
        if name == "none" or s is None:
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
        "met": None if value is None else bool(value["median"] >= TARGET_SPEEDUP),
    }


def _fmt(v: dict[str, Any] | None, f: str = ".0f", scale: float = 1.0) -> str:
    return harness.fmt(v, f, scale)


def _params(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.2f}M"


def markdown(data: dict[str, Any]) -> list[str]:
    """The tables and notes, from the flat view of :meth:`Cluster.view`."""
    setup = data["setup"]
    hidden = "-".join(str(h) for h in data["hidden"])
    ps_hidden = "-".join(str(h) for h in data["ps_hidden"])
    probes = setup.get("probes", {})
    probe_text = ", ".join(f"{k}: {v:.0f} Mbit/s" if v else f"{k}: failed" for k, v in probes.items())
    lines = [
        f"**Setup.** A network-namespace cluster of 3 hosts on one bridge (host 0 and host 1: the workers; host 2: the"
        f" parameter server), built by `ds_lightning.testing.netns.Cluster`; one process per TF_CONFIG task, 1 thread"
        f" each, gloo, `Trainer(devices=1)`, no MASTER_ADDR/MASTER_PORT/GLOO_SOCKET_IFNAME in the environment (the pack"
        f" picks each task's interface). Links shaped on both directions of a host's veth by `Cluster.shape`"
        f" (qdisc: {setup.get('qdisc_kind', '?')}). Measured TCP throughput host 1 -> host 0 (one stream, Python"
        f" sockets): {probe_text or 'not probed'}. {data['repeats']} interleaved repeat(s); median [min - max] over"
        f" repeats, ratios taken per repeat. Total time {data['seconds'] / 60:.1f} min on a shared 2-core machine.",
        "",
    ]
    comp = data.get("compression")
    if comp is not None:
        acc = data.get("accuracy", {})
        names = [c["name"] for c in data["compression_configs"]]
        params = data.get("params")
        lines += [
            f"**1. ds_mirrored gradient_compression on shaped links** (2 worker hosts, both links shaped alike;"
            f" MLP 64-{hidden}-10 = {_params(params)} parameters, DigitsClassifier, SGD lr {LR} momentum 0.9, batch"
            f" {BATCH} per worker; {data['warmup']} warm-up + {data['steps']} timed steps per run; step time = rank 0's"
            " median over the timed steps, batch start to batch end;"
            f" powersgd_start_iter={data['powersgd_start_iter']}: only the first warm-up step is a plain all-reduce,"
            " every timed step is compressed). Speedup ="
            f" none's step time / the setting's, per repeat. Accuracy: validation accuracy of rank 0's final"
            f" parameters (360 held-out digits), after the {data['warmup'] + data['steps']} steps of the shaped runs"
            f" (median over all their runs), and after {data['acc_steps']} steps in one extra run per setting on the"
            " unshaped cluster link (same seed and data order; the link changes a step's duration, not its result).",
            "",
        ]
        steps_short = data["warmup"] + data["steps"]
        head = "| gradient_compression | MB/step (timed) |"
        sep = "|---|---|"
        for link in LINKS:
            head += f" {link['label']}: step (ms); speedup |"
            sep += "---|"
        head += f" unshaped step (ms), 1 run | val acc after {steps_short} steps (%)"
        head += f" | val acc after {data['acc_steps']} steps (%) |"
        sep += "---|---|---|"
        lines += [head, sep]
        for name in names:
            mb = next(
                (comp[k][name]["bytes_per_step"] for k in comp if comp[k].get(name, {}).get("bytes_per_step")), None
            )
            row = f"| {name} | {'-' if mb is None else format(mb['median'] / 1e6, '.3f')} |"
            accs: list[float] = []
            for link in LINKS:
                if link["key"] in setup["unsupported"]:
                    row += f" {NO_NETEM} |"
                    continue
                v = comp.get(link["key"], {}).get(name)
                if v is None or v["step_ms"] is None:
                    row += f" failed ({v['failed_runs']} of {v['runs']}) |" if v else " - |"
                    continue
                failed = f" ({v['failed_runs']} of {v['runs']} failed)" if v["failed_runs"] else ""
                speed = "" if name == "none" else f"; **{_fmt(v['speedup_over_none'], '.2f')}x**"
                row += f" {_fmt(v['step_ms'], '.0f')}{failed}{speed} |"
                accs += [r["final_acc"] for r in data["raw"]["compression"][link["key"]][name] if "error" not in r]
            a = acc.get(name, {})
            unshaped = f"{a['median_step_ms']:.0f}" if "median_step_ms" in a else "failed"
            long = f"{100 * a['final_acc']:.1f}" if "final_acc" in a else "failed"
            lines.append(row + f" {unshaped} | {_fmt(spread(accs), '.1f', 100)} | {long} |")
        t = data["targets"][0]
        result = {True: "PASS", False: "**MISS**", None: "no data"}[t["met"]]
        lines += [
            "",
            "| target | goal | measured | result |",
            "|---|---|---|---|",
            f"| {t['target']} | {t['goal']} | {t['best'] or '-'}: {_fmt(t['value'], '.2f')}x | {result} |",
            "",
        ]
        for name, points in t.get("excluded_for_accuracy_points", {}).items():
            why = "its accuracy run failed" if points is None else f"{points:+.1f} points vs none after the same steps"
            lines += [f"{name} is left out of the verdict: {why}.", ""]
        if setup["unsupported"]:
            lines += [
                f"The 1 ms delay cells: `Cluster.shape(host, rate_mbit=..., delay_ms=1)` raised"
                f" `ShapingUnsupportedError` ({NO_NETEM}; tbf can limit the rate but not add delay), so they hold no"
                " numbers.",
                "",
            ]
    ps = data.get("ps")
    if ps is not None:
        lines += [
            f"**2. ds_parameter_server vs ds_mirrored, worker links 10x apart** (worker 0 at"
            f" {UNEVEN_MBIT[0]:.0f} Mbit/s, worker 1 at {UNEVEN_MBIT[1]:.0f} Mbit/s, the server's link unshaped; MLP"
            f" 64-{ps_hidden}-10, batch {BATCH} per worker, equal samples: ds_mirrored {data['ps_steps']} steps per"
            f" worker = {WORKERS * data['ps_steps'] * BATCH} samples, ds_parameter_server an update budget of the same"
            " samples, fast workers doing more of them). Samples/s: samples of both workers / (last step end - first"
            " step start). Accuracy: rank 0's final parameters (under ds_parameter_server the last pulled ones).",
            "",
            "| configuration | samples/s | vs ds_mirrored | final val acc (%) | acc vs ds_mirrored (points) | samples"
            " | steps w0 / w1 | median step w0 / w1 (ms) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, v in ps.items():
            failed = f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""
            lines.append(
                f"| {name}{failed} | {_fmt(v['samples_per_s'])} | {_fmt(v.get('throughput_over_mirrored'), '.2f')}"
                f" | {_fmt(v['final_acc'], '.1f', 100)} | {_fmt(v.get('acc_points_vs_mirrored'), '+.1f')}"
                f" | {_fmt(v['samples'])} | {_fmt(v['steps_w0'])} / {_fmt(v['steps_w1'])}"
                f" | {_fmt(v['step_ms_w0'])} / {_fmt(v['step_ms_w1'])} |"
            )
        lines.append("")
    bal = data.get("balance")
    if bal is not None:
        lines += [
            "**3. DynamicLoadBalancer vs the equal split on the same uneven link**"
            f" (ds_mirrored, MLP 64-{ps_hidden}-10, global batch {data['global_batch']}; equal split ="
            " `DynamicLoadBalancer(interval=0,"
            f" initial_shares=[1, 1])`, balanced = `interval={data['interval']}`; {data['balance_warmup_epochs']}"
            f" warm-up + {data['balance_epochs']} timed epochs; epoch time = rank 0's, median over the timed epochs."
            " Compute per sample = batch start to the launch of the last gradient bucket (what the balancer"
            " measures) / local batch).",
            "",
            "| configuration | epoch (s) | median step, rank 0 (ms) | compute/sample rank 0 / rank 1 (ms)"
            " | final rank-0 share | final sizes | final val acc (%) |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in (EQUAL, BALANCED):
            v = bal.get(name)
            if v is None:
                continue
            failed = f" ({v['failed_runs']} failed)" if v["failed_runs"] else ""
            sizes = ", ".join(str(x) for x in v["final_sizes"]) or "-"
            lines.append(
                f"| {name}{failed} | {_fmt(v['epoch_s'], '.2f')} | {_fmt(v['step_ms'])}"
                f" | {_fmt(v['compute_ms_per_sample_r0'], '.3f')} / {_fmt(v['compute_ms_per_sample_r1'], '.3f')}"
                f" | {_fmt(v['final_share_rank0'], '.3f')} | {sizes} | {_fmt(v['final_acc'], '.1f', 100)} |"
            )
        lines += [
            "",
            "| balanced / equal, per repeat | median [min - max] |",
            "|---|---|",
            f"| epoch time | {_fmt(bal['ratio_epoch'], '.3f')} |",
            f"| median step time, rank 0 | {_fmt(bal['ratio_step'], '.3f')} |",
            "",
        ]
    return [*lines, *data.get("notes", [])]


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib  # here: running the benchmark needs no matplotlib until it writes

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    comp = data.get("compression") or {}
    names = [c["name"] for c in data.get("compression_configs", [])]
    measured = [link for link in LINKS if link["key"] in comp and link["key"] not in data["setup"]["unsupported"]]
    ax = axes[0][0]
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        xs, med, lo, hi = [], [], [], []
        for i, link in enumerate(measured):
            v = comp[link["key"]].get(name, {}).get("step_ms")
            if v:
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                med.append(v["median"])
                lo.append(v["median"] - v["min"])
                hi.append(v["max"] - v["median"])
        ax.bar(xs, med, width=width, yerr=[lo, hi], capsize=3, label=name)
        for x, link in zip(xs, measured, strict=False):
            s = comp[link["key"]][name]["speedup_over_none"]
            if s and name != "none":
                top = comp[link["key"]][name]["step_ms"]["max"]
                ax.annotate(f"{s['median']:.1f}x", (x, top), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(measured)), [link["label"] for link in measured])
    ax.set_yscale("log")
    ax.set_ylabel("median step time, rank 0 (ms, log)")
    missing = [link["label"] for link in LINKS if link["key"] in data["setup"]["unsupported"]]
    title = f"1. ds_mirrored, {_params(data.get('params'))} params, 2 hosts (label: speedup over none)"
    if missing:
        title += f"\nnot measured (no netem): {', '.join(missing)}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")

    ax = axes[0][1]
    acc = data.get("accuracy") or {}
    shown = [n for n in names if "final_acc" in acc.get(n, {})]
    ax.bar(range(len(shown)), [100 * acc[n]["final_acc"] for n in shown], color="tab:green")
    for i, n in enumerate(shown):
        ax.annotate(f"{100 * acc[n]['final_acc']:.1f}", (i, 100 * acc[n]["final_acc"]), ha="center", va="bottom")
    ax.set_xticks(range(len(shown)), shown)
    ax.set_ylim(0, 105)
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(f"1. accuracy after {data.get('acc_steps')} steps (one run per setting, unshaped link)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")

    ax = axes[1][0]
    ps = data.get("ps") or {}
    shown = [n for n in ps if ps[n]["samples_per_s"]]
    med = [ps[n]["samples_per_s"]["median"] for n in shown]
    err = [
        [m - ps[n]["samples_per_s"]["min"] for n, m in zip(shown, med, strict=True)],
        [ps[n]["samples_per_s"]["max"] - m for n, m in zip(shown, med, strict=True)],
    ]
    ax.bar(range(len(shown)), med, yerr=err, capsize=4, color=["tab:gray", "tab:blue", "tab:orange"][: len(shown)])
    for i, n in enumerate(shown):
        a = ps[n]["final_acc"]
        label = f"acc {100 * a['median']:.1f}%" if a else ""
        ratio = ps[n].get("throughput_over_mirrored")
        if ratio:
            label = f"{ratio['median']:.2f}x, {label}"
        ax.annotate(label, (i, ps[n]["samples_per_s"]["max"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shown)), shown)
    ax.set_ylabel("samples/s, both workers (median, min-max)")
    ax.set_title(
        f"2. worker links {UNEVEN_MBIT[0]:.0f} / {UNEVEN_MBIT[1]:.0f} Mbit/s, equal samples (label: vs ds_mirrored)",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="y")

    ax = axes[1][1]
    raw = (data.get("raw") or {}).get("balance") or {}
    colors = {EQUAL: "tab:gray", BALANCED: "tab:blue"}
    for name in (EQUAL, BALANCED):
        for i, run in enumerate(r for r in raw.get(name, []) if "error" not in r):
            label = f"{name}: step time" if i == 0 else None
            ax.plot(range(len(run["step_ms"])), run["step_ms"], color=colors[name], alpha=0.6, lw=1, label=label)
    twin = ax.twinx()
    for name in (EQUAL, BALANCED):
        for i, run in enumerate(r for r in raw.get(name, []) if "error" not in r):
            shares = [s[0] / sum(s) for s in run["sizes"]]
            label = f"{name}: rank-0 share" if i == 0 else None
            twin.plot(range(len(shares)), shares, "--", color=colors[name], alpha=0.8, lw=1, label=label)
    twin.set_ylim(0, 1)
    twin.set_ylabel("rank 0's share of the global batch (dashed)")
    ax.set_xlabel("step")
    ax.set_ylabel("step time, rank 0 (ms)")
    ratio = (data.get("balance") or {}).get("ratio_epoch")
    title = "3. DynamicLoadBalancer vs equal split, same uneven link"
    if ratio:
        title += f"; epoch time balanced / equal {ratio['median']:.3f}"
    ax.set_title(title, fontsize=9)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def notes(data: dict[str, Any]) -> list[str]:
    """Observations computed from the figures, so they always describe the numbers above them."""
    out = []
    comp = data.get("compression") or {}
    for link in LINKS:
        v = comp.get(link["key"], {}).get("none") or {}
        if v.get("step_ms") and v.get("bytes_per_step"):
            payload = v["bytes_per_step"]["median"]
            wire_ms = payload * 8 / (link["rate_mbit"] * 1e6) * 1e3
            out.append(
                f"- {link['label']}: none takes {v['step_ms']['median']:.0f} ms per step; its {payload / 1e6:.1f} MB"
                f" of gradients alone need {wire_ms:.0f} ms at the link rate (a 2-rank ring all-reduce sends about the"
                " payload once each way)."
            )
    acc = data.get("accuracy") or {}
    base = acc.get("none", {})
    if "final_acc" in base:
        same = [
            n
            for n, a in acc.items()
            if n != "none" and a.get("final_acc") == base["final_acc"] and a.get("param_checksum") is not None
        ]
        moved = [n for n in same if acc[n]["param_checksum"] != base.get("param_checksum")]
        if moved:
            out.append(
                f"- {', '.join(moved)} {'ends' if len(moved) == 1 else 'end'} with the same accuracy as none after"
                f" {data['acc_steps']} steps, but not the"
                " same parameters (sum of |parameters|: "
                + ", ".join(f"{n} {acc[n]['param_checksum']:.4f}" for n in ["none", *moved])
                + "): the narrower all-reduce rounds the gradients, too little to change a prediction here."
            )
        for n, a in acc.items():
            if n != "none" and "final_acc" in a and a["final_acc"] < base["final_acc"] - 0.02:
                out.append(
                    f"- {n} is {100 * (base['final_acc'] - a['final_acc']):.1f} points below none after"
                    f" {data['acc_steps']} steps (powersgd_start_iter={data['powersgd_start_iter']}: compressed from"
                    f" step {data['powersgd_start_iter'] + 1} on; starting PowerSGD later, as its authors recommend,"
                    " keeps more accuracy at the price of uncompressed early steps)."
                )
    ps = data.get("ps") or {}
    for name, v in ps.items():
        if name != MIRRORED and v.get("steps_w0") and v.get("throughput_over_mirrored"):
            out.append(
                f"- {name}: worker 0 (fast link) ran {v['steps_w0']['median']:.0f} steps of"
                f" {v['step_ms_w0']['median']:.0f} ms, worker 1 (slow link) {v['steps_w1']['median']:.0f} of"
                f" {v['step_ms_w1']['median']:.0f} ms (a pull and a push of the whole model per step); under"
                f" ds_mirrored both wait for the slow link every step ({ps[MIRRORED]['step_ms_w0']['median']:.0f} ms)."
                f" Throughput {v['throughput_over_mirrored']['median']:.2f}x ds_mirrored's."
                if ps.get(MIRRORED, {}).get("step_ms_w0")
                else f"- {name}: throughput {v['throughput_over_mirrored']['median']:.2f}x ds_mirrored's."
            )
    bal = data.get("balance") or {}
    v, e = bal.get(BALANCED) or {}, bal.get(EQUAL) or {}
    if v.get("final_share_rank0") and e.get("compute_ms_per_sample_r0") and e.get("step_ms"):
        share, ratio = v["final_share_rank0"], bal.get("ratio_epoch")
        out.append(
            "- DynamicLoadBalancer divides the batch by compute throughput, timed up to the launch of the last gradient"
            " bucket, which leaves the all-reduce out. Under the equal split that compute was"
            f" {e['compute_ms_per_sample_r0']['median']:.3f} / {e['compute_ms_per_sample_r1']['median']:.3f} ms per"
            f" sample on rank 0 / rank 1 (median), about"
            f" {e['compute_ms_per_sample_r0']['median'] * data['global_batch'] / WORKERS:.0f} ms per rank per step"
            f" out of a {e['step_ms']['median']:.0f} ms step: the"
            " all-reduce over the slow link dominates and waits for it whatever the split. So the balancer has no"
            " real imbalance to correct; its final rank-0 share was"
            f" {share['median']:.3f} [{share['min']:.3f} - {share['max']:.3f}] (following noise in the compute"
            f" measurement on this shared machine) and the epoch time balanced / equal {_fmt(ratio, '.3f')}."
        )
    return ["**Notes**", "", *out] if out else []


def _flat(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """The run records of ``{name: record}`` or ``{name: [record, ...]}``."""
    return [r for v in runs.values() for r in (v if isinstance(v, list) else [v])]


def _staleness(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


class Cluster(harness.Benchmark):
    name = "cluster"
    description = __doc__
    defaults = {"repeats": 3, "steps": 5, "warmup": 2, "acc_steps": 60, "ps_steps": 50, "balance_epochs": 5}
    defaults |= {"balance_warmup_epochs": 3}
    quick = {"repeats": 1, "steps": 2, "warmup": 1, "acc_steps": 6, "ps_steps": 8, "balance_epochs": 1}
    quick |= {"balance_warmup_epochs": 1}

    def options(self, parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--steps", type=int, default=None, help="part 1: timed steps per run (5; 2 with --quick)")
        add("--warmup", type=int, default=None, help="part 1: warm-up steps per run (2; 1 with --quick)")
        add("--acc-steps", type=int, default=None, help="part 1: steps of the accuracy runs (60; 6)")
        add("--hidden", type=int, nargs="+", default=[2240, 2240, 2240], help="part 1's hidden widths")
        add("--powersgd-ranks", type=int, nargs="+", default=[1, 4], help="PowerSGD ranks to try (1 4)")
        add("--powersgd-start-iter", type=int, default=1, help="plain all-reduce steps first (1)")
        add("--ps-hidden", type=int, nargs="+", default=[1024, 1024], help="parts 2 and 3's widths")
        add("--ps-steps", type=int, default=None, help="part 2: ds_mirrored steps per worker (50; 8)")
        add("--ps-staleness", type=_staleness, nargs="+", default=[None], help="part 2: max_staleness values (none)")
        add("--balance-epochs", type=int, default=None, help="part 3: timed epochs (5; 1 with --quick)")
        add("--balance-warmup-epochs", type=int, default=None, help="part 3: untimed epochs (3; 1)")
        add("--global-batch", type=int, default=512, help="part 3: samples per step (512)")
        add("--interval", type=int, default=3, help="part 3: the balancer's re-division interval (3)")
        add("--parts", nargs="+", choices=["compression", "ps", "balance"], default=["compression", "ps", "balance"])
        add("--timeout", type=float, default=240.0, help="seconds one configuration may take (240)")
        add("--dist-timeout", type=int, default=120, help="seconds any collective or server reply waits")

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        """Part 1 on every link, then parts 2 and 3, per repeat; then the accuracy runs. Raw results by part."""
        missing = netns.missing_requirements()
        if missing is not None:
            print(f"cluster benchmark skipped: the network-namespace cluster cannot be built here: {missing}")
            raise SystemExit(0)
        comp_names = [c["name"] for c in compression_configs(opts)]
        raw: dict[str, Any] = {
            "compression": {link["key"]: {n: [] for n in comp_names} for link in LINKS},
            "ps": {c["name"]: [] for c in ps_configs(opts)},
            "balance": {EQUAL: [], BALANCED: []},
        }
        setup: dict[str, Any] = {"links": {}, "unsupported": {}, "probes": {}}
        accuracy: dict[str, Any] = {}
        with netns.Cluster(3) as cluster:
            setup["hosts"] = [{"name": h.name, "address": h.address} for h in cluster.hosts]
            setup["qdisc_kind"] = "netem" if netns.netem_available() else "tbf (no netem in this kernel)"
            for label, rate in (("unshaped", None), ("1 Gbit/s", 1000.0), ("100 Mbit/s", 100.0)):
                if rate is None:
                    for host in cluster.hosts:
                        cluster.unshape(host)
                else:
                    shape_links(cluster, {i: (rate, None) for i in range(WORKERS)})
                setup["probes"][label] = probe_link(cluster, 1, 0, 200.0 if rate is None else rate / 8 * 1.5)
                print(f"  link probe host 1 -> host 0, {label}: {setup['probes'][label] or 0:.0f} Mbit/s", flush=True)
            for r in range(opts.repeats):
                if "compression" in opts.parts:
                    run_compression_round(cluster, r, opts, raw["compression"], setup)
                if "ps" in opts.parts or "balance" in opts.parts:
                    run_uneven_round(cluster, r, opts, raw, setup)
            if "compression" in opts.parts:
                accuracy = run_accuracy(cluster, opts)
        params = (
            r["params"] for runs in [accuracy, *raw["compression"].values()] for r in _flat(runs) if "params" in r
        )
        return {
            "compression_configs": compression_configs(opts),
            "params": next(params, None),
            "setup": setup,
            "accuracy": accuracy,
            "launches": LAUNCHES,
            "records": [],  # this benchmark keeps its runs by part, link and configuration in "raw"
            "raw": raw,
        }

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        parts, raw = data["settings"]["parts"], data["raw"]
        comp = summarise_compression(raw["compression"]) if "compression" in parts else None
        out = {
            "compression": comp,
            "ps": summarise_ps(raw["ps"]) if "ps" in parts else None,
            "balance": summarise_balance(raw["balance"]) if "balance" in parts else None,
            "targets": [verdict(comp, data.get("accuracy") or {})] if comp is not None else [],
        }
        out["notes"] = notes(self.view({**data, "summary": out}))
        return out

    @staticmethod
    def view(data: dict[str, Any]) -> dict[str, Any]:
        """One flat mapping of the options, the run's facts and the summary, as the tables read them."""
        return {**data["settings"], **data, **data["summary"]}

    def report(self, data: dict[str, Any]) -> list[str]:
        return markdown(self.view(data))

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        plot(self.view(data), out / "cluster.png")
        return [out / "cluster.png"]


if __name__ == "__main__":
    harness.main(Cluster())
