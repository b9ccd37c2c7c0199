"""gradient_compression="auto" on 2 namespace hosts: a 100 Mbit/s link gets compression, and when the test lifts the
shaping mid-run the choice returns to "none" within two probe intervals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_lightning.testing.netns import Cluster
from tests.cluster.tasks import Task, assert_succeeded, cluster_spec, fit_args, start_all, step_of, wait, wait_for_step

pytestmark = pytest.mark.multiprocess

STEPS, INTERVAL, START, RESHAPE_AT = 48, 8, 4, 12


def test_auto_compresses_on_a_slow_link_and_returns_to_none_when_it_is_lifted(cluster_factory, tmp_path):
    cluster: Cluster = cluster_factory(2)
    for host in cluster.hosts:
        cluster.shape(host, rate_mbit=100)
    heartbeat, record = tmp_path / "heartbeat", tmp_path / "auto"
    args = fit_args(
        "mirrored.yaml",
        tmp_path,
        f"--trainer.max_steps={STEPS}",
        "--trainer.limit_val_batches=0",
        "--trainer.strategy=ds_lightning.strategies.MirroredStrategy",
        "--trainer.strategy.init_args.timeout=120",
        "--trainer.strategy.init_args.gradient_compression=auto",
        f"--trainer.strategy.init_args.auto_interval={INTERVAL}",
        f"--trainer.strategy.init_args.powersgd_start_iter={START}",
        "--model.init_args.hidden_sizes=[512, 512]",  # 1.2 MB of gradient: ~0.1 s a step at 100 Mbit/s uncompressed
        "--trainer.callbacks+=tests.helpers.callbacks.Heartbeat",
        f"--trainer.callbacks.path={heartbeat}",
        "--trainer.callbacks.delay_s=0.05",  # stretches the run so the reshape lands mid-training
        "--trainer.callbacks+=tests.helpers.callbacks.RecordAuto",
        f"--trainer.callbacks.path={record}",
    )
    hosts = {"worker": cluster.hosts}
    tasks: list[Task] = start_all(cluster_spec(hosts), hosts, args, tmp_path / "logs")
    wait_for_step(heartbeat, 0, RESHAPE_AT, tasks)
    for host in cluster.hosts:
        cluster.unshape(host)
    lifted_at = max(step_of(heartbeat, rank) for rank in (0, 1)) + 1  # the first step that may run unshaped
    wait(tasks)
    assert_succeeded(tasks)

    ranks = [json.loads(Path(f"{record}.rank{r}.json").read_text()) for r in (0, 1)]
    made = [(d["step"], d["choice"]) for d in ranks[0]["decisions"]]
    assert made == [(d["step"], d["choice"]) for d in ranks[1]["decisions"]]
    assert lifted_at < 2 * INTERVAL, (lifted_at, made)  # the shaped phase covered the set-up and the first probe
    # Shaped: half width until PowerSGD's warm-up ends, PowerSGD from then on.
    assert made[:3] == [(0, "fp16"), (START, "powersgd"), (INTERVAL, "powersgd")], made
    # Lifted: "none" at a probe no later than two intervals after the link changed, and kept.
    back = [step for step, choice in made if step >= lifted_at and choice == "none"]
    assert back and back[0] <= lifted_at + 2 * INTERVAL, (lifted_at, made)
    assert all(choice == "none" for step, choice in made if step >= back[0]), made
    assert ranks[0]["choice"] == "none" and ranks[0]["step"] == STEPS
    slow = ranks[0]["decisions"][2]
    # On the slow link PowerSGD was predicted to save a quarter or more of the step (measured: about half, the rest
    # being the Heartbeat's sleep and compute).
    assert slow["predicted_s"]["powersgd"] < 0.75 * slow["predicted_s"]["none"], slow
