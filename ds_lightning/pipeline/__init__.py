"""Pipeline and model parallelism: split and balance, profiling, layout, schedules, runtime, state, trace."""

from ds_lightning.pipeline.layout import PipelineLayout
from ds_lightning.pipeline.partition import check_balance, partition_by_cost, resolve_balance, stage_layer_ranges

__all__ = ["PipelineLayout", "check_balance", "partition_by_cost", "resolve_balance", "stage_layer_ranges"]
