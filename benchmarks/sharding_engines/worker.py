"""One sharding-engines run: a plain torch training loop on N CPU processes under one engine, ``ddp``, ``zero`` or
``fsdp`` (see ``README.md``). Rank 0 writes ``result.json`` and, with a ``params_path``, the final parameters."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import workloads as _workloads
from benchmarks.sharding_engines.common import (
    broadcast_bytes,
    fsdp_bytes,
    make_optimizer,
    rank_figures,
    timed_steps,
)
from ds_lightning.sharding import shard_optimizer
from ds_lightning.sharding.fsdp2 import shard_units


def _wrap(engine: str, workload: _workloads.Workload, world: int):
    """The module to call, the optimizer, and this rank's counted bytes per step."""
    net = workload.net
    sent = {"allreduce_bytes": 0, "broadcast_bytes": 0, "allgather_bytes": 0, "reducescatter_bytes": 0}
    if engine == "fsdp":
        for unit in shard_units(net):
            fully_shard(unit, reshard_after_forward=False)
        fully_shard(net, reshard_after_forward=False)
        sent["allgather_bytes"], sent["reducescatter_bytes"] = fsdp_bytes(list(net.parameters()), world)
        return net, make_optimizer(workload.name, net.parameters()), sent
    sent["allreduce_bytes"] = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    module, optimizer = DistributedDataParallel(net), make_optimizer(workload.name, net.parameters())
    if engine == "zero":
        optimizer = shard_optimizer(optimizer)
        owned = broadcast_bytes(optimizer._partition_parameters(), bool(optimizer.parameters_as_bucket_view))
        sent["broadcast_bytes"] = owned[dist.get_rank()]
    return module, optimizer, sent


def train(rank: int, spec: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One rank: train ``warmup + steps`` steps under the spec's engine and report; returns what :func:`_rank` keeps
    alive."""
    torch.set_num_threads(1)
    world = spec["procs"]
    timeout = datetime.timedelta(seconds=spec.get("timeout", 300))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        workload = _workloads.build(spec["workload"], spec["hidden"])
        module, optimizer, sent = _wrap(spec["engine"], workload, world)
        torch.manual_seed(1000 + rank)  # dropout, if any: the same stream per rank in every engine
        total = spec["warmup"] + spec["steps"]
        step_ms = timed_steps(workload, module, optimizer, world, rank, spec["batch_size"], total)
        params = [p.full_tensor() if isinstance(p, DTensor) else p for p in workload.net.parameters()]
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, rank_figures(rank, optimizer, sent))
        if rank == 0:
            timed = step_ms[spec["warmup"] :]
            out = {"median_step_ms": statistics.median(timed), "step_ms": timed, "ranks": ranks}
            Path(spec["out_dir"], "result.json").write_text(json.dumps({**out, "parameters": workload.parameters}))
            if spec.get("params_path"):
                torch.save(torch.cat([p.detach().flatten() for p in params]), spec["params_path"])
        dist.barrier()
        return module, optimizer
    finally:
        dist.destroy_process_group()


def _rank(rank: int, spec: dict[str, Any]) -> None:
    """A spawned rank: :func:`train`, then ``os._exit`` without teardown.

    Freeing DDP's reducer, the last owner of a destroyed gloo group, can deadlock (its destructor joins the gloo
    thread holding the GIL while that thread waits for the GIL; seen at 4 ranks), so nothing is freed before exit.
    """
    code = 1
    try:
        kept = train(rank, spec)  # noqa: F841  (alive until the exit)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    mp.start_processes(_rank, args=(spec,), nprocs=spec["procs"], start_method="spawn")


if __name__ == "__main__":
    main(sys.argv[1])
