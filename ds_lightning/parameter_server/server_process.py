"""A server process's part of ``fit``: build its shard of the user's optimizer, serve until the workers are done."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from torch import Tensor
from torch.optim import Optimizer

from ds_lightning.parameter_server.launch import _ServingFinished
from ds_lightning.parameter_server.optimizer_shard import ShardOptimizer
from ds_lightning.parameter_server.server_loop import ParameterServer, SchedulerSlot
from ds_lightning.parameter_server.sharding import ParameterShardPlan


def serve_shard(
    pg: Any,
    server_index: int,
    num_workers: int,
    optimizer: Optimizer,
    scheduler_configs: Sequence[Any],
    trainable: Mapping[str, Tensor],
    plan: ParameterShardPlan,
    *,
    max_staleness: int | None,
    staleness_lr: str,
    max_updates: int | None,
    timeout: float,
    fail_on_lost_worker: bool = False,
) -> NoReturn:
    """Serve server ``server_index``'s shard of ``trainable`` until every worker finished or was lost.

    Raises:
        _ServingFinished: when done, for the launcher to end the process.
        RuntimeError: when every worker was lost before finishing, or one was with ``fail_on_lost_worker``.

    """
    shard = ShardOptimizer(optimizer, dict(trainable), plan, server_index)
    slots = [SchedulerSlot(c.scheduler, c.interval, c.frequency) for c in scheduler_configs]
    server = ParameterServer(
        pg,
        server_index,
        num_workers,
        shard,
        slots,
        max_staleness,
        staleness_lr,
        max_updates,
        timeout,
        fail_on_lost_worker,
    )
    print(
        f"[ds_lightning] parameter server {server_index} serving {plan.server_numel(server_index)}"
        f" parameters to {num_workers} worker(s)",
        file=sys.stderr,
        flush=True,
    )
    report = server.serve()
    print(
        f"[ds_lightning] parameter server {server_index} done: {report.updates} updates in"
        f" {report.seconds:.1f} s; workers finished {report.finished}, lost {report.lost}",
        file=sys.stderr,
        flush=True,
    )
    if not report.finished:
        raise RuntimeError(
            f"parameter server {server_index}: every worker was lost ({report.lost}) before finishing;"
            " see the workers' errors."
        )
    raise _ServingFinished
