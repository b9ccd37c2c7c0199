"""Benchmarks on shaped links of a multi-host cluster of network namespaces (root): gradient_compression and "auto",
ds_parameter_server vs ds_mirrored, DynamicLoadBalancer on an uneven link, the two-level all-reduce. See README.md."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.cluster import compression, hierarchical, report
from benchmarks.cluster.compression import paired_runs, spreads
from benchmarks.cluster.launch import LAUNCHES, probe_link, run_configs, shape_links
from benchmarks.cluster.report import BALANCED, BATCH, EQUAL, MIRRORED, UNEVEN_MBIT, WORKERS
from benchmarks.harness import round_order, spread
from benchmarks.harness import workloads as _workloads
from benchmarks.load_balance.driver import reading as balance_reading
from ds_lightning.testing import netns

PS_ASYNC = "ps_async"


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
    """The figures ``make bench-balance`` takes from its ranks' records (the records have the same form)."""
    r = balance_reading({"rc": None, "result.0": ranks[0], "result.1": ranks[1]}, warmup_epochs)
    return {
        "median_epoch_s": r["epoch_s"],
        "median_step_ms": r["step_ms"],
        "compute_ms_per_sample": [r["compute_ms_per_sample_r0"], r["compute_ms_per_sample_r1"]],
        **{k: r[k] for k in ("final_sizes", "final_share_rank0", "final_acc")},
    }


def run_uneven_round(
    cluster: netns.Cluster, r: int, opts: argparse.Namespace, raw: dict[str, Any], setup: dict[str, Any]
) -> None:
    """Parts 2 and 3 on the uneven link: ds_mirrored and the balancer's two arms share a launch (none of them needs
    a server), ds_parameter_server has its own; both launches' order and the arms' order rotate by repeat."""
    setup["links"].setdefault("uneven", shape_links(cluster, {i: (UNEVEN_MBIT[i], None) for i in range(WORKERS)}))
    ps = {"kind": "ps", "batch_size": BATCH, "steps": opts.ps_steps}
    balance = {"kind": "balance", "batch_size": opts.global_batch // WORKERS, "global_batch_size": opts.global_batch}
    balance["epochs"] = opts.balance_warmup_epochs + opts.balance_epochs
    shared, server = [], []
    if "ps" in opts.parts:
        shared.append({"name": MIRRORED, "strategy": "ds_mirrored", **ps})
        server.append({"name": PS_ASYNC, "strategy": "ds_parameter_server", **ps})
    if "balance" in opts.parts:
        shared += [{"name": EQUAL, "interval": 0, **balance}, {"name": BALANCED, "interval": opts.interval, **balance}]
    # The digits whatever --model: on the GPT, parts 2 and 3 are parameter_server's and load_balance's benchmarks.
    base = {"kind": "uneven", "hidden": opts.ps_hidden, "lr": report.LR, "seed": 0, "workers": WORKERS}
    base |= {"batch_size": BATCH, "workload": {"model": "digits"}, "dist_timeout": opts.dist_timeout}
    for group in round_order([g for g in (shared, server) if g], r):
        records = run_configs(cluster, {**base, "with_ps": group is server}, round_order(group, r), opts)
        for config in group:
            rec, part = records[config["name"]], config["kind"]
            if "error" not in rec:
                rec = merge_ps(rec) if part == "ps" else merge_balance(rec, opts.balance_warmup_epochs)
            raw[part][config["name"]].append(rec)


def summarise_ps(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    keys = {k: lambda r, k=k: r[k] for k in ("samples_per_s", "samples", "train_s", "final_acc")}
    for w in (0, 1):
        keys |= {f"steps_w{w}": lambda r, w=w: r["steps"][w], f"step_ms_w{w}": lambda r, w=w: r["step_ms"][w]}
    out = {name: spreads(runs, keys) for name, runs in raw.items()}
    for name, runs in raw.items():
        if name != MIRRORED:
            out[name]["throughput_over_mirrored"] = paired_runs(runs, raw[MIRRORED], "samples_per_s")
            out[name]["acc_points_vs_mirrored"] = paired_runs(
                runs, raw[MIRRORED], "final_acc", lambda x, y: 100 * (x - y)
            )
    return out


def summarise_balance(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    keys = {"epoch_s": lambda r: r["median_epoch_s"], "step_ms": lambda r: r["median_step_ms"]}
    keys |= {f"compute_ms_per_sample_r{i}": lambda r, i=i: r["compute_ms_per_sample"][i] for i in (0, 1)}
    keys |= {"final_share_rank0": lambda r: r["final_share_rank0"]}
    out: dict[str, Any] = {}
    for name, runs in raw.items():
        out[name] = spreads(runs, keys)
        out[name]["final_sizes"] = [r["final_sizes"] for r in runs if "error" not in r]
        out[name]["final_acc"] = spread([r["final_acc"] for r in runs if "error" not in r])
    for key, figure in (("ratio_epoch", "median_epoch_s"), ("ratio_step", "median_step_ms")):
        out[key] = paired_runs(raw.get(BALANCED, []), raw.get(EQUAL, []), figure)
    return out


class Cluster(harness.Benchmark):
    name = "cluster"
    description = __doc__
    models = ("digits", "gpt")
    # Part 1's steps, batch, PowerSGD ranks and the parts depend on the workload (compression.MODEL_DEFAULTS).
    defaults = {"repeats": 3, "ps_steps": 20, "balance_epochs": 3, "balance_warmup_epochs": 2, "hier_steps": 5}
    quick = {"repeats": 1, "ps_steps": 8, "balance_epochs": 1, "balance_warmup_epochs": 1, "hier_steps": 2}

    def options(self, parser: argparse.ArgumentParser) -> None:
        def add(flag: str, kind: Any, default: Any, help: str, **kw: Any) -> None:
            parser.add_argument(flag, type=kind, default=default, help=help, **kw)

        many = {"nargs": "+"}
        add("--steps", int, None, "part 1: timed steps per run (digits 3, GPT 6; --quick 2)")
        add("--warmup", int, None, "part 1: warm-up steps per run (2; --quick 1)")
        add("--acc-steps", int, None, "part 1: steps of the accuracy/perplexity runs (60, 150; 6)")
        add("--batch-size", int, None, "part 1: batch per worker (digits 32, GPT 8 windows)")
        add("--val-windows", int, 64, "GPT: validation windows of the perplexity (64)")
        add("--hidden", int, [2240, 2240, 2240], "part 1's hidden widths (digits)", **many)
        add("--powersgd-ranks", int, None, "PowerSGD ranks (digits 4, GPT 4 16)", **many)
        add("--powersgd-start-iter", int, 1, "plain all-reduce steps first (1; auto's too)")
        add("--auto-powersgd-rank", int, None, "the auto arm's powersgd_rank (digits 4, GPT 16; 0: none)")
        add("--auto-interval", int, None, "the auto arm's auto_interval (the strategy's default)")
        add("--ps-hidden", int, [1024, 1024], "parts 2 and 3's widths", **many)
        add("--ps-steps", int, None, "part 2: ds_mirrored steps per worker (20; 8)")
        add("--balance-epochs", int, None, "part 3: timed epochs (3; 1 with --quick)")
        add("--balance-warmup-epochs", int, None, "part 3: untimed epochs (2; 1)")
        add("--global-batch", int, 512, "part 3: samples per step (512)")
        add("--interval", int, 3, "part 3: the balancer's re-division interval (3)")
        parts = ["compression", "ps", "balance", "hierarchical"]
        add("--parts", str, None, "digits: all four; GPT: compression", nargs="+", choices=parts)
        add("--hier-rate", float, 100.0, "part 4: inter-host link in Mbit/s (100)")
        add("--hier-hidden", int, [1024, 1024], "part 4: the digits MLP's widths", **many)
        add("--hier-steps", int, None, "part 4: timed steps per run (5; 2 with --quick)")
        add("--hier-warmup", int, 2, "part 4: warm-up steps per run (2)")
        add("--timeout", float, 240.0, "seconds one configuration may take (240)")
        add("--dist-timeout", int, 120, "seconds any collective or server reply waits")
        _workloads.add_options(parser)

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        compression.model_defaults(opts)
        workload = _workloads.spec_of(opts)
        return {"workload": workload, "workload_label": _workloads.label(workload, opts.hidden)}

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        """The link probes; per repeat part 1 on every link, then parts 2-4; then part 1's long runs."""
        missing = netns.missing_requirements()
        if missing is not None:
            print(f"cluster benchmark skipped: the network-namespace cluster cannot be built here: {missing}")
            raise SystemExit(0)
        configs = compression.compression_configs(opts)
        raw: dict[str, Any] = {
            "compression": {link["key"]: {c["name"]: [] for c in configs} for link in report.links_of(opts.model)},
            "ps": {MIRRORED: [], PS_ASYNC: []},
            "balance": {EQUAL: [], BALANCED: []},
            "hierarchical": {c["name"]: [] for c in hierarchical.hierarchical_configs()},
        }
        setup: dict[str, Any] = {"links": {}, "unsupported": {}, "probes": {}}
        accuracy, accuracy_auto = {}, {}
        with netns.Cluster(3) as cluster:
            setup["hosts"] = [{"name": h.name, "address": h.address} for h in cluster.hosts]
            setup["qdisc_kind"] = "netem" if netns.netem_available() else "tbf (no netem in this kernel)"
            for label, rate in (("unshaped", None), ("1 Gbit/s", 1000.0), ("100 Mbit/s", 100.0)):
                shape_links(cluster, {} if rate is None else {i: (rate, None) for i in range(WORKERS)})
                setup["probes"][label] = probe_link(cluster, 1, 0, 200.0 if rate is None else rate / 8 * 1.5)
            for r in range(opts.repeats):
                if "compression" in opts.parts:
                    compression.run_compression_round(cluster, r, opts, raw["compression"], setup)
                if "ps" in opts.parts or "balance" in opts.parts:
                    run_uneven_round(cluster, r, opts, raw, setup)
                if "hierarchical" in opts.parts:
                    hierarchical.run_hierarchical_round(cluster, r, opts, raw["hierarchical"])
            if "compression" in opts.parts:
                accuracy, accuracy_auto = compression.run_accuracy(cluster, opts, setup)
        runs = [*accuracy.values(), *(r for link in raw["compression"].values() for rs in link.values() for r in rs)]
        return {
            "compression_configs": configs,
            "params": next((r["params"] for r in runs if "params" in r), None),
            "setup": setup,
            "accuracy": accuracy,
            **({"accuracy_auto": accuracy_auto} if accuracy_auto else {}),
            "launches": LAUNCHES,
            "records": [],  # this benchmark keeps its runs by part, link and configuration in "raw"
            "raw": raw,
        }

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        parts, raw = data["settings"]["parts"], data["raw"]
        out = {
            **compression.summarise_part1(data),
            "ps": summarise_ps(raw["ps"]) if "ps" in parts else None,
            "balance": summarise_balance(raw["balance"]) if "balance" in parts else None,
        }
        if "hierarchical" in parts:
            out["hierarchical"] = hierarchical.summarise_hierarchical(raw["hierarchical"])
        out["verdicts"] = [
            *compression.part1_verdicts(out["targets"], out.get("auto")),
            *hierarchical.hierarchical_verdicts(out.get("hierarchical")),
        ]
        return out

    @staticmethod
    def view(data: dict[str, Any]) -> dict[str, Any]:
        """One flat mapping of the options, the run's facts and the summary, as the tables read them."""
        return {**data["settings"], **data, **data["summary"]}

    def report(self, data: dict[str, Any]) -> list[str]:
        view = self.view(data)
        if view["parts"] != ["hierarchical"]:
            lines = report.markdown(view)
        else:
            title = "# Two-level all-reduce in the network-namespace cluster (cluster benchmark, part 4)"
            lines = [title, "", report.setup_line(view)]
        if view.get("hierarchical"):
            lines += hierarchical.hierarchical_markdown(view["hierarchical"], data["settings"])
        return lines

    def file_stem(self, settings: dict[str, Any]) -> str:
        # Part 4 run on its own keeps parts 1-3's results files.
        if settings.get("parts") == ["hierarchical"]:
            return f"{self.name}_hierarchical" + ("_gpt" if settings.get("model") == "gpt" else "")
        return super().file_stem(settings)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        stem, alone = self.file_stem(data["settings"]), data["settings"]["parts"] == ["hierarchical"]
        paths = []
        if not alone:
            paths.append(out / f"{stem}.png")
            report.plot(self.view(data), paths[-1])
        if data["summary"].get("hierarchical"):
            paths.append(out / f"{stem if alone else self.name + '_hierarchical'}.png")
            hierarchical.plot_hierarchical(data["summary"]["hierarchical"], paths[-1])
        return paths


if __name__ == "__main__":
    harness.main(Cluster())
