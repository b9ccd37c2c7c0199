"""One collectives run: N gloo processes check, then time each op of ``OPS`` on one fp32 tensor, the op order rotating
by round; rank 0 writes ``result.json``, per op each timed round's slowest rank in ms (see ``README.md``)."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness.spec import round_order

OPS = ("all_reduce", "reduce_scatter", "all_gather", "rs_ag")


def padded(numel: int, world: int) -> int:
    """``numel`` rounded up to a multiple of the world size (every rank's shard equal)."""
    return numel + (-numel % world)


def rounds(ops: tuple[str, ...], n: int) -> list[list[str]]:
    """Every round's op order: no op always first, last or beside the same op."""
    return [round_order(ops, r) for r in range(n)]


def slowest(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per op, each round's largest time over the ranks (by then the call had finished everywhere)."""
    return {op: [max(ts) for ts in zip(*(r[op] for r in per_rank), strict=True)] for op in per_rank[0]}


def _check(numel: int, world: int, rank: int) -> None:
    """Each op once on rank-dependent data: the sums and the gathered shards must be right before anything is timed."""
    total, x = world * (world + 1) / 2, torch.full((numel,), float(rank + 1))
    shard, gathered = torch.empty(numel // world), torch.empty(numel)
    dist.reduce_scatter_tensor(shard, x.clone())
    dist.all_reduce(x)
    dist.all_gather_into_tensor(gathered, torch.full((numel // world,), float(rank)))
    expected = torch.arange(world, dtype=torch.float32).repeat_interleave(numel // world)
    if not (bool((x == total).all()) and bool((shard == total).all()) and torch.equal(gathered, expected)):
        raise RuntimeError(f"rank {rank}: a collective on gloo returned wrong values at numel {numel}")


def measure(rank: int, spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    world = spec["procs"]
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=spec["timeout"]))
    try:
        numel = padded(spec["numel"], world)
        _check(numel, world, rank)
        whole, source, shard, gathered = (
            torch.ones(numel),
            torch.ones(numel),
            torch.empty(numel // world),
            torch.empty(numel),
        )
        ops = {
            "all_reduce": lambda: dist.all_reduce(whole),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, source),
            "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard),
            "rs_ag": lambda: (dist.reduce_scatter_tensor(shard, source), dist.all_gather_into_tensor(gathered, shard)),
        }
        mine: dict[str, list[float]] = {op: [] for op in OPS}
        for i, order in enumerate(rounds(OPS, spec["warmup"] + spec["iters"])):
            for op in order:
                whole.fill_(1.0)  # the all-reduce sums in place
                dist.barrier()
                start = time.perf_counter()
                ops[op]()
                if i >= spec["warmup"]:
                    mine[op].append((time.perf_counter() - start) * 1000)
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            out = {"procs": world, "numel": numel, "threads": torch.get_num_threads(), "ms": slowest(ranks)}
            Path(spec["out_dir"], "result.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    mp.start_processes(measure, args=(spec,), nprocs=spec["procs"], start_method="spawn")
