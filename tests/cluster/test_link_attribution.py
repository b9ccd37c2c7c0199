"""DistributedReport on real links: one host's link at a tenth of the others' bandwidth is found and blamed.

Three namespace hosts, one ``ds_mirrored`` rank each. The same run twice: every link shaped to 200 Mbit/s, then host
2's link to 20 Mbit/s. The report, from the kernel's TCP counters of gloo's connections, must name host 2's link as
the slow one, and the time it attributes to that link must account for at least 80% of the step time the slow link
added (and not more than the whole of it plus noise). The first run is the control: with equal links no host is
named. Two hosts could not tell which end of their one link is slow, hence three.
"""

from __future__ import annotations

import json
import statistics

import pytest

from ds_lightning.testing.netns import Cluster
from tests.cluster.tasks import assert_succeeded, cluster_spec, fit_args, start_all, wait

pytestmark = pytest.mark.multiprocess

_FAST_MBIT, _SLOW_MBIT = 200.0, 20.0


def _report(cluster: Cluster, tmp_path, name: str) -> dict:
    root = tmp_path / name
    args = fit_args(
        "mirrored.yaml",
        root,
        "--model.hidden_sizes=[256, 256]",  # 340 kB of gradients: 18 ms a step on the fast links, 180 on the slow
        "--trainer.max_steps=40",
        "--trainer.limit_val_batches=0",
        "--trainer.strategy=ds_lightning.strategies.MirroredStrategy",
        "--trainer.strategy.timeout=120",
        "--trainer.callbacks+=ds_lightning.callbacks.DistributedReport",
        "--trainer.callbacks.every_n_steps=0",
        f"--trainer.callbacks.output_dir={root / 'report'}",
    )
    hosts = {"worker": cluster.hosts}
    tasks = start_all(cluster_spec(hosts), hosts, args, root / "logs")
    wait(tasks)
    assert_succeeded(tasks)  # every rank's exit code
    return json.loads((root / "report" / "report.json").read_text())


def _step_ms(document: dict) -> float:
    return statistics.median(r["step_ms"] for r in document["ranks"])


def _host(document: dict, address: str) -> dict:
    return next(h for h in document["links"]["hosts"] if h["host"] == address)


def test_a_link_at_a_tenth_of_the_bandwidth_is_named_and_carries_the_added_step_time(cluster_factory, tmp_path):
    cluster: Cluster = cluster_factory(3)
    slow_host = cluster.hosts[2].address
    for host in cluster.hosts:
        cluster.shape(host, rate_mbit=_FAST_MBIT)
    equal = _report(cluster, tmp_path, "equal")
    cluster.shape(cluster.hosts[2], rate_mbit=_SLOW_MBIT)
    slowed = _report(cluster, tmp_path, "slowed")

    # The control: equal links, no host named.
    assert equal["links"]["slow_host"] is None, equal["links"]
    assert slowed["links"]["slow_host"] == slow_host, slowed["links"]
    assert slowed["verdict"]["bound"] == "link-bound", slowed["verdict"]
    rates = {h["host"]: h["rate_mb_s"] for h in slowed["links"]["hosts"]}
    assert all(rates[h] > 5 * rates[slow_host] for h in rates if h != slow_host), rates
    # Every rank took part: one row per rank, each with wire bytes from its own connections.
    assert [r["rank"] for r in slowed["ranks"]] == [0, 1, 2] and all(r["wire_sent"] > 0 for r in slowed["ranks"])

    added = _step_ms(slowed) - _step_ms(equal)
    attributed = _host(slowed, slow_host)["link_ms"] - _host(equal, slow_host)["link_ms"]
    assert added > 50, (added, equal["ranks"], slowed["ranks"])  # the slow link did slow the run
    assert 0.8 * added <= attributed <= 1.25 * added, (attributed, added, slowed["links"])
