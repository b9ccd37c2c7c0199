"""Shared by ``ds_pipeline`` and ``ds_model_parallel``: layer partitioning, profiling, layout, schedules, traces."""

from ds_lightning.pipelining.layout import PipelineLayout
from ds_lightning.pipelining.partition import partition_by_cost, resolve_balance, stage_layer_ranges

__all__ = ["PipelineLayout", "partition_by_cost", "resolve_balance", "stage_layer_ranges"]
