"""The process groups and ``("dp", "pp")`` device mesh of a pipeline x data parallel run."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ds_lightning.pipeline.layout import PipelineLayout

__all__ = ["PipelineGroups", "build_groups"]


@dataclass(frozen=True)
class PipelineGroups:
    """This process's groups.

    Attributes:
        pipeline: the stages of this process's replica (the schedule's transfers).
        data: this pipeline rank in every replica (gradient averaging).
        output: the same ranks as ``pipeline``, kept for the output broadcast alone.
        mesh: the ``("dp", "pp")`` device mesh over both.

    """

    pipeline: dist.ProcessGroup
    data: dist.ProcessGroup
    output: dist.ProcessGroup
    mesh: DeviceMesh


def build_groups(
    layout: PipelineLayout, global_rank: int, device_type: str, timeout: timedelta | None
) -> PipelineGroups:
    """Create every sub-group of the run; a collective: every rank calls it, and creates each group in one order."""
    grid = torch.arange(layout.world_size).view(layout.data_parallel_size, layout.pipeline_size)
    pp_groups = [dist.new_group(row.tolist(), timeout=timeout) for row in grid]
    dp_groups = [dist.new_group(col.tolist(), timeout=timeout) for col in grid.t()]
    # The output broadcast has groups of its own, so the other stages can post it before the schedule runs
    # without queueing it ahead of the schedule's transfers.
    out_groups = [dist.new_group(row.tolist(), timeout=timeout) for row in grid]
    replica, pipeline_rank = layout.coordinates(global_rank)
    pipeline, data = pp_groups[replica], dp_groups[pipeline_rank]
    mesh = DeviceMesh.from_group([data, pipeline], device_type, mesh=grid, mesh_dim_names=("dp", "pp"))
    return PipelineGroups(pipeline, data, out_groups[replica], mesh)
