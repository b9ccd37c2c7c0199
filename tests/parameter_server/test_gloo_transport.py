"""What gloo point-to-point gives the parameter server: any-source receives, and peers that survive a death."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from tests.helpers.ps_transport import server_and_workers
from tests.helpers.runner import free_port


@pytest.mark.multiprocess
def test_server_receives_from_any_worker_and_survives_a_dead_one(tmp_path):
    out = tmp_path / "facts.json"
    mp.start_processes(server_and_workers, args=(3, free_port(), str(out)), nprocs=3, start_method="spawn")
    facts = json.loads(out.read_text())
    # Every push arrived once, each tagged with its sender, in the order the workers sent them.
    arrivals = sorted(map(tuple, facts["arrivals"]))
    assert arrivals == [(1, 10.0), (1, 11.0), (1, 12.0), (2, 20.0), (2, 21.0), (2, 22.0)]
    for worker in (1, 2):
        values = [value for sender, value in facts["arrivals"] if sender == worker]
        assert values == sorted(values)
    # A receive from the dead worker fails at once instead of hanging until the timeout...
    assert facts["dead_recv"] == "raised"
    assert facts["dead_recv_seconds"] < 10  # the group timeout is 60 s
    # ...and the server keeps talking to the live worker, by rank and from any source.
    assert facts["live_after_death"] == 99.0
    assert facts["any_source_after_death"] == [1, 98.0]
