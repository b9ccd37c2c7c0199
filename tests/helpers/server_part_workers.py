"""Two parameter-server processes saving their parts together, one of which cannot build its part.

``python -m tests.helpers.server_part_workers MODE FOLDER`` on 2 ranks (``LOCAL_RANK``, ``MASTER_PORT`` from the
environment), on a gloo group whose collectives wait :data:`TIMEOUT_S`. Server 0's part fails with a planted error:
``in_plan`` builds it inside DCP's planning step (as ``write_server_part`` does), ``before`` builds it before the save
starts (the control). Each rank prints ``failed after S s: TEXT`` and exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from ds_lightning.parameter_server.server_checkpoint import RowBlock, RowBlockPlanner

TIMEOUT_S = 8
PLANTED = "planted: server 0 cannot build its part"


def _part(rank: int) -> tuple[dict[str, Any], list[RowBlock]]:
    if rank == 0:
        raise RuntimeError(PLANTED)
    whole = torch.arange(8.0).view(4, 2)
    return {}, [RowBlock(("model", "w"), whole[2:].clone(), whole.shape, 2)]


def main(mode: str, folder: str) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    start = time.monotonic()
    try:
        if mode == "before":
            part = _part(rank)
            planner = RowBlockPlanner(lambda: part)
        else:
            planner = RowBlockPlanner(lambda: _part(rank))
        dcp.save({}, storage_writer=FileSystemWriter(Path(folder)), planner=planner)
        print("saved", flush=True)
    except (Exception, CheckpointException) as error:  # DCP's derives from BaseException only
        print(f"failed after {time.monotonic() - start:.1f} s: {type(error).__name__}: {error}"[:3000], flush=True)
        if rank == 0:
            # A server that failed keeps serving: the process stays, as the parameter server's loop does.
            time.sleep(TIMEOUT_S + 4)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
