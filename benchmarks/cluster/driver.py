"""Benchmarks on shaped links of a real multi-host cluster made of network namespaces, every task driven by TF_CONFIG.

Builds its own cluster of 3 hosts (``ds_lightning.testing.netns.Cluster``: namespaces on one bridge, needs root and
iproute2; it skips with the missing requirement otherwise) and runs every task as its own process on its own host,
configured by ``TF_CONFIG`` alone: no ``MASTER_ADDR``/``MASTER_PORT``, and ``GLOO_SOCKET_IFNAME`` is never set here (the
pack picks the interface holding each task's address). Hosts 0 and 1 are the two workers; host 2 holds the parameter
server. Links are shaped with ``Cluster.shape`` (both directions of a host's link; ``tbf`` rate limiting on kernels
without ``netem``, where a delay cannot be emulated). Every process runs 1 thread.

1. **gradient_compression on slow links.** ds_mirrored on 2 worker hosts, on the ``--model`` workload. Digits: the
   classifier widened to about 10M parameters (64-2240-2240-2240-10), batch 32 per worker, both workers' links shaped
   to 1 Gbit/s, then 100 Mbit/s (and the same with 1 ms delay, measured only where the kernel has netem). GPT: the
   byte-level GPT (default shape, 0.9M parameters; AdamW lr 1e-3), 8 windows of 128 tokens per worker, on the
   1 Gbit/s and 100 Mbit/s links. Settings none, fp16, bf16 and powersgd at ``--powersgd-ranks`` (digits 1 4, GPT
   1 4 16); ``powersgd_start_iter`` is ``--powersgd-start-iter`` (1: only the first warm-up step is a plain
   all-reduce, every timed step is compressed). Step time = rank 0's median over the timed steps; speedup = none /
   setting per repeat; the GPT's throughput in tokens/s. Target: at 100 Mbit/s the best setting is >= 5x faster than
   none. Accuracy (digits): rank 0's validation accuracy after the timed runs' steps, and after ``--acc-steps``
   steps in one extra run per setting on the unshaped cluster link (the link changes how long a step takes, not what
   it computes); only settings within 1 point of none's count for the target. Perplexity (GPT): the same extra run
   (``--acc-steps`` 200: 409,600 tokens per setting, same data order and initial parameters), then the validation
   perplexity of rank 0's parameters on the first ``--val-windows`` windows of TextDataModule's validation split;
   only settings within 2% of none's perplexity count, and the smallest PowerSGD rank within 2% is reported.
   ``gradient_compression="auto"`` runs next to the fixed settings (``--auto-powersgd-rank``: digits 4, GPT 16, the
   smallest ranks the verdict admitted; 0 drops it) and is judged at each link against the best fixed setting within
   the verdict's bounds (target auto / best <= 1.10), its accuracy or perplexity from one ``--acc-steps`` run on each
   shaped link (``cluster/auto_report.py``).
2. **ds_parameter_server vs ds_mirrored on an uneven link.** Worker 0's link at 1 Gbit/s, worker 1's at 100 Mbit/s,
   the server's unshaped; 64-1024-1024-10 (1.1M parameters), batch 32 per worker, equal samples: ds_mirrored runs
   ``--ps-steps`` steps per worker, ds_parameter_server (``--ps-staleness``, default fully asynchronous) gets an update
   budget of the same samples. Samples/s = samples of both workers / (last step end - first step start).
3. **DynamicLoadBalancer vs the equal split on the same uneven link.** ds_mirrored, 64-1024-1024-10, global batch
   ``--global-batch``, ``DynamicLoadBalancer(interval=0)`` (equal split) against ``interval=--interval``; rank 0's
   epoch time (median over the timed epochs). The balancer times compute, not the wire.

4. **Two-level all-reduce (``hierarchical``) against the flat ring**, 2 hosts x 2 processes (one TF_CONFIG task per
   host with ``Trainer(devices=2)``), both hosts' links at ``--hier-rate`` (100 Mbit/s), the digits MLP
   ``--hier-hidden`` (64-1024-1024-10), uncompressed and fp16: inter-host bytes per step read from the hosts' veths,
   rank 0's median step, and the final parameters against the flat ring's (``cluster/hierarchical.py``). With
   ``--model gpt --parts hierarchical``, the GPT (part 1's AdamW, 8 windows of 128 tokens per process) instead.

Parts 2 and 3 always train the digits MLP; with ``--model gpt`` they, and part 4, run only when ``--parts`` names them
(on the GPT, parts 2 and 3 are measured by ``parameter_server.py`` and ``load_balance.py``). Results of ``--model gpt``
go to ``results/cluster_gpt.*``; part 4 run on its own to ``results/cluster_hierarchical[_gpt].*``.

Configurations are interleaved repeat by repeat (each repeat: part 1 on every link, then parts 2 and 3; within a
launch the configurations run one after the other in one process per task, the order rotating by repeat), repeated
``--repeats`` times; the tables give medians, per-repeat ratios and the min-max spread. Every launch has a time limit
per configuration: a configuration that fails or hangs is recorded as failed and the launch's remaining
configurations are started again without it. The cluster is always torn down.

The launching and link plumbing is in ``cluster/launch.py``, part 1 in ``cluster/compression.py``, the report in
``cluster/report.py``; the command line is the benchmark harness's.

    python -m benchmarks.cluster.driver [--quick] [--model digits|gpt] [--repeats 3] [--out DIR] [--render [JSON]]
                                 [--steps 5] [--warmup 2] [--acc-steps 60] [--batch-size 32] [--val-windows 64]
                                 [--gpt-layers 4 --gpt-heads 4 --gpt-width 128 --gpt-block 128]
                                 [--powersgd-ranks 1 4] [--powersgd-start-iter 1] [--auto-powersgd-rank 4]
                                 [--auto-interval 500] [--ps-steps 50]
                                 [--ps-staleness none] [--balance-epochs 5] [--balance-warmup-epochs 3]
                                 [--global-batch 512] [--interval 3] [--parts compression ps balance hierarchical]
                                 [--hier-rate 100] [--hier-steps 8] [--hier-hidden 1024 1024]
                                 [--timeout 240] [--dist-timeout 120]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.cluster.auto_report import auto_markdown, auto_verdicts, summarise_auto
from benchmarks.cluster.compression import (
    compact_runs,
    compression_configs,
    gpt_markdown,
    is_gpt,
    model_defaults,
    ppl_verdict,
    run_accuracy,
    run_auto_accuracy,
    run_compression_round,
    summarise_compression,
    tokens_per_step,
    verdict,
)
from benchmarks.cluster.hierarchical import add_options as add_hierarchical_options
from benchmarks.cluster.hierarchical import (
    hierarchical_configs,
    hierarchical_markdown,
    hierarchical_verdicts,
    plot_hierarchical,
    run_hierarchical_round,
    summarise_hierarchical,
)
from benchmarks.cluster.launch import LAUNCHES, WORKERS, probe_link, run_configs, shape_links
from benchmarks.cluster.report import (
    BALANCED,
    BATCH,
    EQUAL,
    LR,
    MIRRORED,
    TARGET_SPEEDUP,
    UNEVEN_MBIT,
    links_of,
    markdown,
    notes,
    plot,
)
from benchmarks.harness import round_order, spread
from benchmarks.harness import workloads as _workloads
from benchmarks.load_balance.driver import reading as balance_reading
from ds_lightning.testing import netns

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
    base["workload"] = {"model": "digits"}  # whatever --model: on the GPT these parts are other benchmarks'
    if "ps" in opts.parts:
        for config in round_order(ps_configs(opts), r):
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
        records, launches = run_configs(cluster, spec, round_order(configs, r), opts)
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


def _flat(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """The run records of ``{name: record}`` or ``{name: [record, ...]}``."""
    return [r for v in runs.values() for r in (v if isinstance(v, list) else [v])]


def _staleness(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


class Cluster(harness.Benchmark):
    name = "cluster"
    description = __doc__
    models = ("digits", "gpt")
    # Part 1's steps, batch, PowerSGD ranks and the parts depend on the workload (compression.MODEL_DEFAULTS).
    defaults = {"repeats": 3, "ps_steps": 50, "balance_epochs": 5, "balance_warmup_epochs": 3, "hier_steps": 8}
    quick = {"repeats": 1, "ps_steps": 8, "balance_epochs": 1, "balance_warmup_epochs": 1, "hier_steps": 2}

    def options(self, parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--steps", type=int, default=None, help="part 1: timed steps per run (digits 5, GPT 10; --quick 2)")
        add("--warmup", type=int, default=None, help="part 1: warm-up steps per run (digits 2, GPT 3; --quick 1)")
        add("--acc-steps", type=int, default=None, help="part 1: steps of the accuracy/perplexity runs (60, 200; 6)")
        add("--batch-size", type=int, default=None, help="part 1: batch per worker (digits 32, GPT 8 windows)")
        add("--val-windows", type=int, default=64, help="GPT: validation windows of the perplexity (64)")
        add("--hidden", type=int, nargs="+", default=[2240, 2240, 2240], help="part 1's hidden widths (digits)")
        add("--powersgd-ranks", type=int, nargs="+", default=None, help="PowerSGD ranks (digits 1 4, GPT 1 4 16)")
        add("--powersgd-start-iter", type=int, default=1, help="plain all-reduce steps first (1; auto's too)")
        add(
            "--auto-powersgd-rank",
            type=int,
            default=None,
            help="the auto arm's powersgd_rank (digits 4, GPT 16; 0: no arm)",
        )
        add(
            "--auto-interval", type=int, default=None, help="the auto arm's auto_interval (the strategy's default, 500)"
        )
        add("--ps-hidden", type=int, nargs="+", default=[1024, 1024], help="parts 2 and 3's widths")
        add("--ps-steps", type=int, default=None, help="part 2: ds_mirrored steps per worker (50; 8)")
        add("--ps-staleness", type=_staleness, nargs="+", default=[None], help="part 2: max_staleness values (none)")
        add("--balance-epochs", type=int, default=None, help="part 3: timed epochs (5; 1 with --quick)")
        add("--balance-warmup-epochs", type=int, default=None, help="part 3: untimed epochs (3; 1)")
        add("--global-batch", type=int, default=512, help="part 3: samples per step (512)")
        add("--interval", type=int, default=3, help="part 3: the balancer's re-division interval (3)")
        add(
            "--parts",
            nargs="+",
            choices=["compression", "ps", "balance", "hierarchical"],
            default=None,
            help="parts to run (digits: compression ps balance hierarchical; GPT: compression, or hierarchical)",
        )
        add_hierarchical_options(parser)
        add("--timeout", type=float, default=240.0, help="seconds one configuration may take (240)")
        add("--dist-timeout", type=int, default=120, help="seconds any collective or server reply waits")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        model_defaults(opts)
        workload = _workloads.spec_of(opts)
        return {"workload": workload, "workload_label": _workloads.label(workload, opts.hidden)}

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        """Part 1 on every link, then parts 2 and 3, per repeat; then the accuracy runs. Raw results by part."""
        missing = netns.missing_requirements()
        if missing is not None:
            print(f"cluster benchmark skipped: the network-namespace cluster cannot be built here: {missing}")
            raise SystemExit(0)
        comp_names = [c["name"] for c in compression_configs(opts)]
        raw: dict[str, Any] = {
            "compression": {link["key"]: {n: [] for n in comp_names} for link in links_of(opts.model)},
            "ps": {c["name"]: [] for c in ps_configs(opts)},
            "balance": {EQUAL: [], BALANCED: []},
            "hierarchical": {c["name"]: [] for c in hierarchical_configs()},
        }
        setup: dict[str, Any] = {"links": {}, "unsupported": {}, "probes": {}}
        accuracy: dict[str, Any] = {}
        accuracy_auto: dict[str, Any] = {}
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
                if "hierarchical" in opts.parts:
                    run_hierarchical_round(cluster, r, opts, raw["hierarchical"])
            if "compression" in opts.parts:
                accuracy = run_accuracy(cluster, opts)
                accuracy_auto = run_auto_accuracy(cluster, opts, setup)
        params = (
            r["params"] for runs in [accuracy, *raw["compression"].values()] for r in _flat(runs) if "params" in r
        )
        return {
            "compression_configs": compression_configs(opts),
            "params": next(params, None),
            "setup": setup,
            "accuracy": accuracy,
            **({"accuracy_auto": accuracy_auto} if accuracy_auto else {}),
            "launches": LAUNCHES,
            "records": [],  # this benchmark keeps its runs by part, link and configuration in "raw"
            "raw": raw,
        }

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        parts, raw = data["settings"]["parts"], data["raw"]
        gpt = is_gpt(data["settings"])
        tokens = tokens_per_step(data["settings"]) if gpt else None
        comp = summarise_compression(raw["compression"], tokens) if "compression" in parts else None
        accuracy = data.get("accuracy") or {}
        if comp is None:
            targets = []
        else:
            targets = [ppl_verdict(comp, accuracy, data["compression_configs"]) if gpt else verdict(comp, accuracy)]
        out = {
            "compression": comp,
            "ps": summarise_ps(raw["ps"]) if "ps" in parts else None,
            "balance": summarise_balance(raw["balance"]) if "balance" in parts else None,
            "targets": targets,
        }
        if comp is not None and any(c["compression"] == "auto" for c in data["compression_configs"]):
            accuracy_auto = data.get("accuracy_auto") or {}
            out["auto"] = summarise_auto(comp, raw["compression"], accuracy, accuracy_auto, data["settings"])
        if "hierarchical" in parts:  # results from before part 4 keep their summary
            out["hierarchical"] = summarise_hierarchical(raw["hierarchical"])
        out["notes"] = notes(self.view({**data, "summary": out}))
        out["verdicts"] = [
            *(
                harness.judged(
                    f"{t['target']} (best: {t['best'] or '-'})", t["value"], at_least=TARGET_SPEEDUP, unit="x"
                )
                for t in targets
            ),
            *auto_verdicts(out.get("auto")),
            *hierarchical_verdicts(out.get("hierarchical")),
        ]
        return out

    @staticmethod
    def view(data: dict[str, Any]) -> dict[str, Any]:
        """One flat mapping of the options, the run's facts and the summary, as the tables read them."""
        return {**data["settings"], **data, **data["summary"]}

    def compact(self, data: dict[str, Any]) -> dict[str, Any]:
        return compact_runs(data)

    def report(self, data: dict[str, Any]) -> list[str]:
        view = self.view(data)
        if view["parts"] == ["hierarchical"]:
            probes = ", ".join(f"{k}: {v:.0f} Mbit/s" for k, v in data["setup"]["probes"].items() if v)
            lines = [
                "# Two-level all-reduce in the network-namespace cluster (cluster benchmark, part 4)",
                "",
                f"Commit {data['package'].get('commit', '?')}; qdisc {data['setup'].get('qdisc_kind', '?')}; measured"
                f" TCP throughput host 1 -> host 0: {probes}. {view['repeats']} interleaved repeat(s); median"
                f" [min - max] over repeats. Total time {data['seconds'] / 60:.1f} min on a shared 2-core machine.",
            ]
        else:
            part1 = gpt_markdown(view) if is_gpt(view) and view.get("compression") else None
            lines = markdown(view, part1, auto_markdown(view))
        if view.get("hierarchical"):
            lines += hierarchical_markdown(view["hierarchical"], data["settings"])
        return lines

    def file_stem(self, settings: dict[str, Any]) -> str:
        # Part 4 run on its own keeps parts 1-3's results files.
        if settings.get("parts") == ["hierarchical"]:
            return f"{self.name}_hierarchical" + ("_gpt" if is_gpt(settings) else "")
        return super().file_stem(settings)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        stem = self.file_stem(data["settings"])
        paths = []
        if set(data["settings"]["parts"]) - {"hierarchical"}:
            paths.append(out / f"{stem}.png")
            plot(self.view(data), paths[-1])
        if data["summary"].get("hierarchical"):
            alone = data["settings"]["parts"] == ["hierarchical"]  # then the stem is part 4's own
            paths.append(out / f"{stem if alone else self.name + '_hierarchical'}.png")
            plot_hierarchical(data["summary"]["hierarchical"], paths[-1])
        return paths


if __name__ == "__main__":
    harness.main(Cluster())
