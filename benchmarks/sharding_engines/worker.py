"""One sharding-engines run: a plain torch training loop (no Lightning) on N CPU processes under one engine, ``ddp``,
``zero`` or ``fsdp`` (see ``README.md``). Rank 0 writes ``result.json`` (every rank's figures, its step times) and,
with a ``params_path``, the final parameters for the parity check.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import sys
import time
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
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import workloads as _workloads
from benchmarks.sharding_engines.common import broadcast_bytes, fsdp_bytes, make_optimizer
from ds_lightning.sharding import optimizer_state_bytes, shard_optimizer
from ds_lightning.sharding.fsdp2 import shard_units


def _batches(workload: _workloads.Workload, spec: dict[str, Any], rank: int):
    sampler = DistributedSampler(workload.train_set, spec["procs"], rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(workload.train_set, batch_size=spec["batch_size"], sampler=sampler, drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _wrap(engine: str, workload: _workloads.Workload, model_name: str, world: int):
    """The module to call, the optimizer, and this rank's counted bytes per step (a dict)."""
    net = workload.net
    grad = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    if engine == "fsdp":
        for unit in shard_units(net):
            fully_shard(unit, reshard_after_forward=False)
        fully_shard(net, reshard_after_forward=False)
        gather, scatter = fsdp_bytes(list(net.parameters()), world)
        sent = {"allreduce_bytes": 0, "broadcast_bytes": 0, "allgather_bytes": gather, "reducescatter_bytes": scatter}
        return net, make_optimizer(model_name, net.parameters()), sent
    module = DistributedDataParallel(net)
    optimizer = make_optimizer(model_name, net.parameters())
    bcast = 0
    if engine == "zero":
        optimizer = shard_optimizer(optimizer)
        bcast = broadcast_bytes(optimizer._partition_parameters(), bool(optimizer.parameters_as_bucket_view))
        bcast = bcast[dist.get_rank()]
    sent = {"allreduce_bytes": grad, "broadcast_bytes": bcast, "allgather_bytes": 0, "reducescatter_bytes": 0}
    return module, optimizer, sent


def train(rank: int, spec: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One rank: train ``warmup + steps`` steps under the spec's engine and report; returns what :func:`_rank` keeps
    alive."""
    torch.set_num_threads(1)
    world = spec["procs"]
    timeout = datetime.timedelta(seconds=spec.get("timeout", 300))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        model_name = spec["workload"]["model"]
        workload = _workloads.build(spec["workload"], spec["hidden"])
        module, optimizer, sent = _wrap(spec["engine"], workload, model_name, world)
        torch.manual_seed(1000 + rank)  # dropout, if any: the same stream per rank in every engine
        batches = _batches(workload, spec, rank)
        step_ms = []
        for _ in range(spec["warmup"] + spec["steps"]):
            x, y = next(batches)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            workload.loss(module(x), y).backward()
            optimizer.step()
            step_ms.append((time.perf_counter() - start) * 1000)
        params = [p.full_tensor() if isinstance(p, DTensor) else p for p in workload.net.parameters()]
        mine = {
            "rank": rank,
            "optimizer_class": type(optimizer).__name__,
            "state_bytes": optimizer_state_bytes(optimizer),
            **sent,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        }
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, mine)
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
