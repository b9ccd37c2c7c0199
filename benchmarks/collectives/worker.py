"""One collectives run: N gloo processes check, then time ``all_reduce``, ``reduce_scatter``, ``all_gather`` and the
two back to back (``rs_ag``) on one fp32 tensor, the op order rotating by round (see ``README.md``). Rank 0 writes
``result.json``: per op, each timed round's slowest rank, in ms.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Callable
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
    """Every round's op order (:func:`harness.round_order`): no op always first, last or beside the same op."""
    return [round_order(ops, r) for r in range(n)]


def slowest(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per op, each round's largest time over the ranks (by then the call had finished everywhere)."""
    return {op: [max(ts) for ts in zip(*(r[op] for r in per_rank), strict=True)] for op in per_rank[0]}


def _calls(numel: int, world: int) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """The four ops on fixed buffers, and the reset of the all-reduce's input between calls (it sums in place)."""
    whole = torch.ones(numel)
    shard = torch.empty(numel // world)
    gathered = torch.empty(numel)
    source = torch.ones(numel)

    def rs_ag() -> None:
        dist.reduce_scatter_tensor(shard, source)
        dist.all_gather_into_tensor(gathered, shard)

    ops = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, source),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard),
        "rs_ag": rs_ag,
    }
    return ops, lambda: whole.fill_(1.0)


def _check(numel: int, world: int, rank: int) -> None:
    """Each op once on rank-dependent data: the sums and the gathered shards must be right before anything is timed."""
    total = world * (world + 1) / 2
    x = torch.full((numel,), float(rank + 1))
    dist.all_reduce(x)
    shard = torch.empty(numel // world)
    dist.reduce_scatter_tensor(shard, torch.full((numel,), float(rank + 1)))
    gathered = torch.empty(numel)
    dist.all_gather_into_tensor(gathered, torch.full((numel // world,), float(rank)))
    expected = torch.arange(world, dtype=torch.float32).repeat_interleave(numel // world)
    if not (bool((x == total).all()) and bool((shard == total).all()) and torch.equal(gathered, expected)):
        raise RuntimeError(f"rank {rank}: a collective on gloo returned wrong values at numel {numel}")


def measure(rank: int, spec: dict[str, Any]) -> None:
    """One rank: join the group, check, time ``warmup + iters`` rounds; rank 0 writes the slowest rank's times."""
    torch.set_num_threads(1)
    world = spec["procs"]
    timeout = datetime.timedelta(seconds=spec.get("timeout", 300))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        numel = padded(spec["numel"], world)
        _check(numel, world, rank)
        ops, reset = _calls(numel, world)
        mine: dict[str, list[float]] = {op: [] for op in OPS}
        for i, order in enumerate(rounds(OPS, spec["warmup"] + spec["iters"])):
            for op in order:
                reset()
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


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    mp.start_processes(measure, args=(spec,), nprocs=spec["procs"], start_method="spawn")


if __name__ == "__main__":
    main(sys.argv[1])
