"""Workers for the gloo transport facts the parameter server relies on (spawned by tests/ps/test_gloo_transport.py)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def server_and_workers(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 serves; workers 1.. push 3 tensors each; the last worker then dies without leaving the group."""
    faulthandler.dump_traceback_later(90, exit=True, file=sys.stderr)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    dying = world - 1
    if rank == 0:
        facts: dict[str, object] = {}
        buf = torch.zeros(4)
        arrivals = []
        for _ in range(3 * (world - 1)):
            work = dist.irecv(buf)  # from any source
            work.wait()
            arrivals.append([work._source_rank(), float(buf[0])])
        facts["arrivals"] = arrivals
        start = time.monotonic()
        try:
            dist.recv(buf, src=dying)
            facts["dead_recv"] = "returned"
        except RuntimeError:
            facts["dead_recv"] = "raised"
        facts["dead_recv_seconds"] = time.monotonic() - start
        dist.recv(buf, src=1)
        facts["live_after_death"] = float(buf[0])
        work = dist.irecv(buf)
        work.wait()
        facts["any_source_after_death"] = [work._source_rank(), float(buf[0])]
        Path(out).write_text(json.dumps(facts))
    else:
        for step in range(3):
            time.sleep(0.02 * rank)
            dist.send(torch.full((4,), float(rank * 10 + step)), dst=0)
        if rank == dying:
            os._exit(0)  # killed: no destroy_process_group, no goodbye
        time.sleep(1.0)
        dist.send(torch.full((4,), 99.0), dst=0)
        dist.send(torch.full((4,), 98.0), dst=0)
    # The group lost a member; tearing it down could block on it, so leave without it.
    os._exit(0)
