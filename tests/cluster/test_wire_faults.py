"""Faults on the wire between namespace hosts: what each strategy promises, and that nothing hangs past its timeout.

- ds_mirrored rides out a link cut shorter than its ``timeout`` (TCP retransmits; gloo waits up to ``timeout``); this
  is also the two-host ds_mirrored run, with test_multihost.py's checks (accuracy, listeners).
- A link cut for good fails every rank with ds_mirrored's collective error within the timeout, and a hang verdict
  that names the rank on the other side as unreachable; it leaves no process behind, and the last checkpoint resumes
  once the link is back.
- Under ds_parameter_server a worker whose link is cut for a few seconds does not hold the chief back, and the run
  ends with both workers finished; a worker host whose processes all die does not stop the other worker.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from ds_lightning.testing.netns import Cluster
from tests.cluster.tasks import (
    RUN_TIMEOUT,
    Task,
    assert_succeeded,
    cluster_spec,
    fit_args,
    run_watched,
    start_all,
    step_of,
    wait,
    wait_for_step,
)

pytestmark = pytest.mark.multiprocess


def _args(config: str, tmp_path, heartbeat, *extra: str, delay_s: float = 0.05) -> list[str]:
    return fit_args(
        config,
        tmp_path,
        "--trainer.callbacks+=tests.helpers.callbacks.Heartbeat",
        f"--trainer.callbacks.path={heartbeat}",
        f"--trainer.callbacks.delay_s={delay_s}",  # stretches the run so the fault lands mid-training
        *extra,
    )


# Past the collective timeout: ranks report the failure and exit; wait() kills whatever is left after this.
_KILL_MARGIN_S = 60


def _mirrored(timeout: float) -> list[str]:
    return ["--trainer.strategy=ds_lightning.strategies.MirroredStrategy", f"--trainer.strategy.timeout={timeout}"]


def test_ds_mirrored_trains_across_two_hosts_through_a_link_cut_shorter_than_its_timeout(cluster_factory, tmp_path):
    cluster: Cluster = cluster_factory(2)
    heartbeat = tmp_path / "heartbeat"

    def cut_for_three_seconds(tasks: list[Task]) -> None:
        wait_for_step(heartbeat, 0, 5, tasks)
        cluster.cut(cluster.hosts[1])
        time.sleep(0.5)
        during = step_of(heartbeat, 0)
        time.sleep(3)
        assert step_of(heartbeat, 0) <= during + 1  # the cut did stop the all-reduce
        assert all(t.proc.poll() is None for t in tasks)  # and nobody gave up during it
        cluster.restore(cluster.hosts[1])

    args = _args("mirrored.yaml", tmp_path, heartbeat, "--trainer.max_steps=60", *_mirrored(timeout=60))
    tasks = run_watched(cluster, {"worker": cluster.hosts}, args, tmp_path, during=cut_for_three_seconds)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in tasks[1].output
    assert step_of(heartbeat, 0) == step_of(heartbeat, 1) == 60


def test_a_link_cut_for_good_fails_every_rank_in_time_and_the_checkpoint_resumes(cluster_factory, tmp_path):
    cluster: Cluster = cluster_factory(2)
    hosts = {"worker": cluster.hosts}
    spec = cluster_spec(hosts)
    heartbeat, ckpt = tmp_path / "heartbeat", tmp_path / "ckpt"
    timeout = 10
    args = _args(
        "mirrored.yaml",
        tmp_path,
        heartbeat,
        "--trainer.max_steps=60",
        *_mirrored(timeout),
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpt}",
        "--trainer.callbacks.every_n_train_steps=5",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks+=tests.helpers.callbacks.SaveParams",
        f"--trainer.callbacks.path={tmp_path / 'final'}",
    )
    tasks = start_all(spec, hosts, args, tmp_path / "cut")
    wait_for_step(heartbeat, 0, 12, tasks)
    cluster.cut(cluster.hosts[1])
    waited = wait(tasks, timeout=timeout + _KILL_MARGIN_S)
    for rank, task in enumerate(tasks):
        assert task.proc.returncode not in (0, None), task.output[-3000:]
        assert f"ds_mirrored: a collective failed on rank {rank} (timeout {timeout} s)" in task.output, task.output[
            -3000:
        ]
    assert waited < timeout + _KILL_MARGIN_S  # the collective timeout ended it, not the test's kill
    assert [cluster.pids(host) for host in cluster.hosts] == [[], []]  # no process left behind on any host
    # The hang verdict on each side of the cut: the other rank did not answer (its host can't be reached), within
    # timeout + 10 s; each rank dumped its Flight Recorder.
    for rank, task in enumerate(tasks):
        verdict = json.loads((tmp_path / "flight_recorder" / f"verdict_rank{rank}.json").read_text())
        assert (verdict["kind"], verdict["silent"]) == ("silent", [1 - rank]), verdict
        # The cut stops whichever collective is on the wire: DDP's gradient all-reduce or Lightning's step broadcast.
        assert verdict["stuck"]["op"] in ("all_reduce", "broadcast"), verdict
        assert verdict["after_s"] <= timeout + 10, verdict
        assert f"Did not answer: rank {1 - rank} (the process is gone, or its host cannot be reached" in task.output
        assert (tmp_path / "flight_recorder" / f"fr_rank_{rank}").exists()
    last = ckpt / "last.ckpt"
    assert last.exists(), sorted(p.name for p in ckpt.iterdir())
    saved = torch.load(last, weights_only=False)["global_step"]  # read now: the resumed run rewrites last.ckpt
    assert 0 < saved < 60

    cluster.restore(cluster.hosts[1])
    resumed = start_all(spec, hosts, [*args, f"--ckpt_path={last}"], tmp_path / "resumed")
    wait(resumed)
    assert_succeeded(resumed)
    assert "Restored all states from the checkpoint" in resumed[0].output
    assert step_of(heartbeat, 0) == step_of(heartbeat, 1) == 60
    # Each rank trained only the steps after the checkpoint's; a run that ignored it would train all 60 (the control).
    for rank in range(2):
        assert torch.load(tmp_path / f"final.rank{rank}.pt")["batches_this_run"] == 60 - saved


def _parameter_server(cluster: Cluster, tmp_path, heartbeat, delay_s: float = 0.05) -> tuple[dict, list[str]]:
    chief, worker, server = cluster.hosts
    hosts = {"chief": [chief], "worker": [worker], "ps": [server]}
    args = _args(
        "parameter_server.yaml",
        tmp_path,
        heartbeat,
        "--trainer.max_epochs=2",
        "--trainer.strategy.init_args.num_servers=1",
        "--trainer.strategy.init_args.timeout=60",
        delay_s=delay_s,
    )
    return hosts, args


def test_ds_parameter_server_chief_trains_on_while_a_worker_link_is_cut(cluster_factory, tmp_path):
    cluster: Cluster = cluster_factory(3)
    heartbeat = tmp_path / "heartbeat"
    # 0.1 s per step: the chief's epoch (23 steps) outlasts the cut, so it can't stop at the epoch's end in between.
    hosts, args = _parameter_server(cluster, tmp_path, heartbeat, delay_s=0.1)
    worker = hosts["worker"][0]

    def cut_the_worker_for_three_seconds(tasks: list[Task]) -> None:
        wait_for_step(heartbeat, 0, 2, tasks)
        cluster.cut(worker)
        time.sleep(0.5)
        chief_before, worker_before = step_of(heartbeat, 0), step_of(heartbeat, 1)
        time.sleep(3)
        # Asynchronous: the chief is not held back by the cut-off worker (up to the epoch's end, where the workers'
        # metrics meet), while the worker waits for the pull that cannot reach it.
        assert step_of(heartbeat, 0) >= chief_before + 3
        assert step_of(heartbeat, 1) <= worker_before + 2
        assert all(t.proc.poll() is None for t in tasks)
        cluster.restore(worker)

    tasks = run_watched(cluster, hosts, args, tmp_path, during=cut_the_worker_for_three_seconds)
    ps_task = next(t for t in tasks if t.role == "ps")
    assert re.search(r"workers finished \[(0, 1|1, 0)\], lost \[\]", ps_task.output), ps_task.output[-3000:]


def test_ds_parameter_server_worker_host_killed_the_other_worker_finishes(cluster_factory, tmp_path):
    cluster: Cluster = cluster_factory(3)
    heartbeat = tmp_path / "heartbeat"
    hosts, args = _parameter_server(cluster, tmp_path, heartbeat)
    worker = hosts["worker"][0]
    tasks = start_all(cluster_spec(hosts), hosts, args, tmp_path)
    wait_for_step(heartbeat, 1, 5, tasks)
    cluster.kill(worker)
    chief_at_kill = step_of(heartbeat, 0)
    waited = wait([t for t in tasks if t.host is not worker])
    ps_task = next(t for t in tasks if t.role == "ps")
    chief_task = next(t for t in tasks if t.role == "chief")
    assert_succeeded([chief_task, ps_task])
    assert waited < RUN_TIMEOUT  # they finished on their own (asserted above too), not killed by wait()
    assert "parameter server 0 lost worker 1" in ps_task.output
    assert "workers finished [0], lost [1]" in ps_task.output
    assert step_of(heartbeat, 0) > chief_at_kill + 10  # the chief went on training after the kill
    assert json.loads((tmp_path / "report.json").read_text())["val_acc"] > 0.5  # 5x chance: it learned alone
