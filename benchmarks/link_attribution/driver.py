"""Does DistributedReport blame a slow link for the step time it adds (target: >= 80% of it attributed to that link)?

Three network-namespace hosts, one ds_mirrored rank each; every link at 200 Mbit/s, then host 2's at 20 Mbit/s. The
arms, the workload, what is read from each report, the target and the options: README.md in this folder (root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import operator
import shutil
import statistics
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.cluster.launch import shape_links
from benchmarks.harness import Arm, Experiment
from benchmarks.link_attribution import launch, page
from ds_lightning.testing import CommandError, netns

EQUAL, SLOWED = "equal", "slowed"
LABELS = {EQUAL: "every link at the fast rate", SLOWED: "host 2's link at the slow rate"}
HOSTS, SLOW_HOST = 3, 2  # two hosts could not tell which end of their one link is slow
TARGET_SHARE = 0.8  # host 2's added link time over the added step time, per repeat (the issue's target)
KEYS = ("step_ms", "host2_link_ms", "host2_rate_mb_s", "other_rate_mb_s")


def reading(document: dict[str, Any], addresses: list[str], result: dict[str, Any]) -> dict[str, Any]:
    """One launch's figures from rank 0's ``report.json``: the median step over ranks, each host's (in cluster order)
    link time and rate, the host named, the verdict's bound, every rank's wire bytes, and the printed table."""
    links = document.get("links") or {"hosts": [], "slow_host": None, "reason": "the report has no links section"}
    by_host = {h["host"]: h for h in links["hosts"]}
    hosts = [by_host.get(address, {}) for address in addresses]
    ranks = sorted(document["ranks"], key=lambda r: r["rank"])
    rates = [h.get("rate_mb_s") for h in hosts]
    others = [rate for i, rate in enumerate(rates) if i != SLOW_HOST]
    slow = links["slow_host"]
    return {
        "exit_codes": result["exit_codes"],
        "launch_s": result["launch_s"],
        "step_ms": statistics.median(r["step_ms"] for r in ranks),
        "rank_step_ms": [r["step_ms"] for r in ranks],
        "link_ms": [h.get("link_ms") for h in hosts],
        "rate_mb_s": rates,
        "host2_link_ms": hosts[SLOW_HOST].get("link_ms"),
        "host2_rate_mb_s": rates[SLOW_HOST],
        "other_rate_mb_s": None if None in others else min(others),  # the slower of the other hosts' links
        "slow_host": slow,
        "named_index": addresses.index(slow) if slow in addresses else None,
        "named_slow": slow == addresses[SLOW_HOST],
        "bound": document["verdict"]["bound"],
        "straggler": document["verdict"].get("straggler"),
        "wire_sent": [r.get("wire_sent") for r in ranks],
        "wire_received": [r.get("wire_received") for r in ranks],
        "table": document.get("table", ""),
    }


def median_launch(records: list[dict[str, Any]]) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """The successful slowed launch whose median step is the median of them (the lower middle for an even count), and
    the equal launch of its repeat when that one succeeded."""
    slowed = sorted(harness.ok(records, SLOWED), key=lambda r: (r["step_ms"], r["repeat"]))
    if not slowed:
        return None, None
    chosen = slowed[(len(slowed) - 1) // 2]
    equal = next((r for r in harness.ok(records, EQUAL) if r["repeat"] == chosen["repeat"]), None)
    return chosen, equal


def shares(records: list[dict[str, Any]]) -> list[float]:
    """Per repeat where both arms ran and the slow link added time: host 2's added link time over the added step."""
    equal = {r["repeat"]: r for r in harness.ok(records, EQUAL)}
    out = []
    for s in sorted(harness.ok(records, SLOWED), key=lambda r: r["repeat"]):
        e = equal.get(s["repeat"])
        if e is None or None in (s["host2_link_ms"], e["host2_link_ms"]) or s["step_ms"] <= e["step_ms"]:
            continue
        out.append((s["host2_link_ms"] - e["host2_link_ms"]) / (s["step_ms"] - e["step_ms"]))
    return out


def counted(records: list[dict[str, Any]], arm: str, named: str) -> dict[str, int]:
    """How many successful launches of ``arm`` have ``named`` true (``named_slow``) or set (``slow_host``)."""
    mine = [r for r in records if r["arm"] == arm]
    good = harness.ok(mine)
    hits = sum(bool(r.get(named)) for r in good)
    return {"named": hits, "launches": len(good), "failed": len(mine) - len(good)}


def of_text(count: dict[str, int]) -> str:
    """``"k of n"`` launches, with the failed ones said beside."""
    return f"{count['named']} of {count['launches']}" + (f" ({count['failed']} failed)" if count["failed"] else "")


class LinkAttribution(harness.Benchmark):
    name = "link_attribution"
    description = __doc__
    defaults = {"repeats": 3, "steps": 40}
    quick = {"repeats": 1, "steps": 12}

    def __init__(self) -> None:
        self.kept: dict[tuple[str, int], Path] = {}  # each successful launch's report folder, until collect ends

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--fast-mbit", type=float, default=200.0, help="every link's rate, Mbit/s (200)")
        parser.add_argument("--slow-mbit", type=float, default=20.0, help="host 2's rate in the slowed arm (20)")
        parser.add_argument("--steps", type=int, help="training steps per launch (40; 12 with --quick)")
        parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256], help="the MLP's widths (256 256)")
        parser.add_argument("--timeout", type=float, default=240.0, help="seconds one launch may take (240)")
        parser.add_argument("--trace-steps", type=int, default=6, help="steps of the kept trace, mid-run (6)")
        parser.add_argument("--dist-timeout", type=int, default=120, help="seconds any collective waits (120)")

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        return {"workload": f"DigitsClassifier 64-{'-'.join(map(str, opts.hidden))}-10, batch 32 per rank"}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        return Experiment([Arm(EQUAL, {}, LABELS[EQUAL]), Arm(SLOWED, {}, LABELS[SLOWED])], opts.repeats, EQUAL)

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        """Builds the cluster, runs the interleaved launches in it, keeps the median slowed launch's PNG and trace."""
        missing = netns.missing_requirements()
        if missing is not None:
            print(f"link_attribution benchmark skipped: the network-namespace cluster cannot be built here: {missing}")
            raise SystemExit(0)
        keep = Path(tempfile.mkdtemp(prefix="ds-link-bench-"))
        try:
            with contextlib.ExitStack() as stack:
                try:
                    cluster = stack.enter_context(netns.Cluster(HOSTS))
                except (CommandError, OSError, RuntimeError) as err:
                    print(f"link_attribution benchmark skipped: the network-namespace cluster was not built: {err}")
                    raise SystemExit(0) from err
                addresses = [host.address for host in cluster.hosts]
                setup: dict[str, Any] = {"hosts": addresses, "links": {}}

                def run(arm: Arm, repeat: int) -> dict[str, Any]:
                    rates: dict[int, tuple[float, float | None]] = {i: (opts.fast_mbit, None) for i in range(HOSTS)}
                    if arm.name == SLOWED:
                        rates[SLOW_HOST] = (opts.slow_mbit, None)
                    setup["links"].setdefault(arm.name, shape_links(cluster, rates))
                    return self.run_in(cluster, keep / f"{arm.name}{repeat}", (arm.name, repeat), opts)

                experiment = self.experiment(opts)
                records = harness.run_experiment(experiment, run, self.progress)
            stem = self.file_stem(vars(opts))
            setup["files"] = page.keep_files(median_launch(records)[0], self.kept, opts.out, stem, opts.trace_steps)
            kept = [v for k, v in setup["files"].items() if k.endswith(("_png", "_json"))]
            print(f"kept {', '.join(kept) or 'nothing (no slowed launch succeeded)'} in {opts.out}", flush=True)
        finally:
            shutil.rmtree(keep, ignore_errors=True)
            self.kept.clear()
        arms = {a.name: a.title for a in experiment.arms}
        return {"arms": arms, "baseline": EQUAL, "setup": setup, "records": records}

    def run_in(
        self, cluster: netns.Cluster, root: Path, key: tuple[str, int], opts: argparse.Namespace
    ) -> dict[str, Any]:
        """One launch under the links as shaped; its reading, or :class:`harness.Failed` naming the rank that failed."""
        result = launch.launch(cluster, root, opts)
        report = root / "report" / "report.json"
        why = launch.failure(result, report.exists())
        if why is not None:
            raise harness.Failed(why, log="\n".join(result["logs"]))
        self.kept[key] = report.parent
        return reading(json.loads(report.read_text()), [host.address for host in cluster.hosts], result)

    def progress(self, r: dict[str, Any]) -> str:
        h2 = "-" if r["host2_link_ms"] is None else f"{r['host2_link_ms']:.0f} ms"
        return f"step {r['step_ms']:.1f} ms, host 2's link {h2}, named {r['slow_host'] or 'none'}, {r['bound']}"

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        records = data["records"]
        s: dict[str, Any] = harness.summarise(records, [EQUAL, SLOWED], KEYS)
        s["added_step_ms"] = harness.paired(records, SLOWED, EQUAL, "step_ms", operator.sub)
        s["attributed_ms"] = harness.paired(records, SLOWED, EQUAL, "host2_link_ms", operator.sub)
        s["share"] = harness.spread(shares(records))
        s["slow_rate_mb_s"] = s[SLOWED]["host2_rate_mb_s"]
        s["other_rate_mb_s"] = s[SLOWED]["other_rate_mb_s"]
        s["named_counts"] = counted(records, SLOWED, "named_slow")
        s["control_named_counts"] = counted(records, EQUAL, "slow_host")
        s["named"], s["control_named"] = of_text(s["named_counts"]), of_text(s["control_named_counts"])
        slowed, equal = median_launch(records)
        s["median_repeat"] = None if slowed is None else slowed["repeat"]
        s["slowed_table"] = "" if slowed is None else slowed["table"]
        s["equal_table"] = "" if equal is None else equal["table"]
        every = s["named_counts"]["named"] == s["named_counts"]["launches"]
        holds = every and s["control_named_counts"]["named"] == 0
        what = "share of the added step time attributed to host 2's link (host 2 named every time, no host in the"
        what += " controls)"
        s["verdicts"] = [harness.judged(what, s["share"], at_least=TARGET_SHARE, holds=holds)]
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        return page.markdown(data, LABELS, SLOW_HOST, TARGET_SHARE)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        return page.trace_png(data, out, self.file_stem(data["settings"]))


if __name__ == "__main__":
    harness.main(LinkAttribution())
