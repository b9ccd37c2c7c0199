"""The degrees of a pipeline x data parallel run, checked once and named in every error."""

from __future__ import annotations

from dataclasses import dataclass

from ds_lightning import _validation as check

__all__ = ["PipelineLayout"]


@dataclass(frozen=True)
class PipelineLayout:
    """How ``world_size`` processes split into pipeline stages and data-parallel replicas.

    Ranks are laid out replica-major: ``rank = replica * pipeline_size + pipeline_rank``, so the stages of one
    replica are neighbouring ranks (and usually share a machine).

    Args:
        world_size: processes in the run.
        data_parallel_size: replicas of the whole pipeline; ``-1`` infers it from ``world_size``, ``stages`` and
            ``stages_per_rank``.
        stages_per_rank: pipeline stages each process runs (2 for interleaved and V-shaped schedules).
        stages: total pipeline stages; ``-1`` infers ``world_size / data_parallel_size * stages_per_rank``.

    """

    world_size: int
    data_parallel_size: int = 1
    stages_per_rank: int = 1
    stages: int = -1

    def __post_init__(self) -> None:
        check.integer("world_size", self.world_size, 1, "PipelineLayout(world_size=4)")
        check.integer("stages_per_rank", self.stages_per_rank, 1, "PipelineLayout(4, stages_per_rank=2)")
        dp, stages = self.data_parallel_size, self.stages
        for name, value in (("data_parallel_size", dp), ("stages", stages)):
            if value != -1:
                check.integer(name, value, 1, f"PipelineLayout(8, {name}=2)", note="or -1 to infer it")
        if dp == -1 and stages == -1:
            raise ValueError("Set data_parallel_size or the number of stages; -1 infers only one of them.")
        if stages != -1 and stages % self.stages_per_rank:
            raise ValueError(
                f"{stages} stages cannot be spread evenly with stages_per_rank={self.stages_per_rank}; "
                f"use a multiple of {self.stages_per_rank} stages."
            )
        if dp == -1:
            pp = stages // self.stages_per_rank
            if self.world_size % pp:
                raise ValueError(
                    f"world size {self.world_size} is not a multiple of the {pp} processes one pipeline of "
                    f"{stages} stages needs; run {pp} x replicas processes."
                )
            object.__setattr__(self, "data_parallel_size", self.world_size // pp)
        elif self.world_size % dp:
            raise ValueError(
                f"world size {self.world_size} is not stages x data_parallel_size: {self.world_size} processes cannot "
                f"form {dp} equal pipeline replicas. Use devices x num_nodes = a multiple of data_parallel_size={dp}, "
                f"or data_parallel_size=1."
            )
        pp = self.world_size // self.data_parallel_size
        if stages == -1:
            object.__setattr__(self, "stages", pp * self.stages_per_rank)
        elif stages != pp * self.stages_per_rank:
            raise ValueError(
                f"{stages} stages x data_parallel_size={self.data_parallel_size} needs "
                f"{stages // self.stages_per_rank * self.data_parallel_size} processes, but the world size is "
                f"{self.world_size}; world size must be (stages / stages_per_rank) x data_parallel_size."
            )

    @property
    def pipeline_size(self) -> int:
        """Processes per pipeline replica."""
        return self.world_size // self.data_parallel_size

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(replica, pipeline_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}.")
        return divmod(rank, self.pipeline_size)

    def stage_indices(self, pipeline_rank: int, style: str = "loop") -> list[int]:
        """The stages a pipeline rank runs: ``loop`` puts ``r, r+p, ...`` on rank ``r``; ``v`` puts ``r, 2p-1-r``."""
        pp = self.pipeline_size
        if style == "v":
            if self.stages_per_rank != 2:
                raise ValueError(f"V-shaped schedules need stages_per_rank=2, got {self.stages_per_rank}.")
            return [pipeline_rank, 2 * pp - 1 - pipeline_rank]
        return [pipeline_rank + k * pp for k in range(self.stages_per_rank)]
