"""One sharding-engines run: a plain torch training loop on N CPU processes under one engine.

Started by ``driver.py`` with a JSON spec (``procs``, ``engine``, the ``"workload"``: the digits
MLP under Adam, or the GPT under AdamW; ``harness/workloads.py``). No Lightning: ``torch.multiprocessing`` starts
the ranks (gloo, 1 thread each), and each trains the same batches from the same seed under one engine:

- ``ddp``: ``DistributedDataParallel`` and the whole optimizer on every rank;
- ``zero``: ``DistributedDataParallel`` and torch's ``ZeroRedundancyOptimizer``, wrapped exactly as
  ``ds_lightning.sharding.shard_optimizer`` wraps it;
- ``fsdp``: FSDP2, ``fully_shard(reshard_after_forward=False)`` on each of ``ds_lightning.sharding.fsdp2.shard_units``
  (the MLP's linear layers; the GPT's embedding, blocks, last norm and head), then on the root, and the optimizer over
  the sharded parameters: the units ``MirroredStrategy(sharding_engine="fsdp2")`` shards.

At the end every rank reads its figures (optimizer-state bytes, payload bytes per step, counted, peak RSS); rank 0
gathers them (a collective every rank joins) and writes ``result.json`` with its step times, and, when the spec names a
``params_path``, the final parameters (whole, flattened in ``parameters()`` order) for the parity check.
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
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import workloads as _workloads
from benchmarks.memory.worker import broadcast_bytes, fsdp_bytes, make_optimizer, padded_shard_bytes
from ds_lightning.sharding import shard_optimizer
from ds_lightning.sharding.fsdp2 import shard_units

__all__ = ["ENGINES", "fsdp_bytes", "padded_shard_bytes", "state_bytes", "train"]

ENGINES = ("ddp", "zero", "fsdp")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds: its shard of a DTensor, its partition under ZeRO."""
    state = optimizer.optim.state if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer.state
    total = 0
    for per_param in state.values():
        for value in per_param.values():
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


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
    trainable = [p for p in net.parameters() if p.requires_grad]
    grad = sum(p.numel() * p.element_size() for p in trainable)
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
    """One rank: join the group, train ``warmup + steps`` steps under the spec's engine, report (rank 0 writes).

    Returns the trained module and its optimizer, for a caller that must keep them alive (see :func:`_rank`).
    """
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
            "state_bytes": state_bytes(optimizer),
            **sent,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        }
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            timed = step_ms[spec["warmup"] :]
            out = {
                "median_step_ms": statistics.median(timed),
                "step_ms": timed,
                "ranks": ranks,
                "parameters": workload.parameters,
            }
            Path(spec["out_dir"], "result.json").write_text(json.dumps(out))
            if spec.get("params_path"):
                torch.save(torch.cat([p.detach().flatten() for p in params]), spec["params_path"])
        dist.barrier()
        return module, optimizer
    finally:
        dist.destroy_process_group()


def _rank(rank: int, spec: dict[str, Any]) -> None:
    """A spawned rank: :func:`train`, then leave at once.

    Freeing DDP's reducer, the last owner of a destroyed gloo group, can deadlock (the group's destructor joins its
    gloo thread while holding the GIL, and that thread waits for the GIL to free a finished all-gather; seen at 4
    ranks), so a rank keeps what :func:`train` returns and exits without teardown once its figures are written; an
    error still exits non-zero, with its traceback.
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
    if spec["engine"] not in ENGINES:
        raise ValueError(f"engine={spec['engine']!r}: choose one of {ENGINES}")
    mp.start_processes(_rank, args=(spec,), nprocs=spec["procs"], start_method="spawn")


if __name__ == "__main__":
    main(sys.argv[1])
