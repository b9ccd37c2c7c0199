"""Pipeline and model parallelism: split and balance, profiling, layout, schedules, runtime, state, trace.

Shared by ``ds_pipeline`` and ``ds_model_parallel``, one concept a module; the pure ones are exported here.
"""

from ds_lightning.pipeline.clock import clock_cycles
from ds_lightning.pipeline.layout import PipelineLayout
from ds_lightning.pipeline.partition import check_balance, partition_by_cost, resolve_balance, stage_layer_ranges
from ds_lightning.pipeline.profile import LayerProfile, auto_balance, profile_layers

__all__ = [
    "LayerProfile",
    "PipelineLayout",
    "auto_balance",
    "check_balance",
    "clock_cycles",
    "partition_by_cost",
    "profile_layers",
    "resolve_balance",
    "stage_layer_ranges",
]
