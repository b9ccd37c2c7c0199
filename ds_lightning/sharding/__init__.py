"""Optimizer-state sharding for ``ds_mirrored``: ``zero`` (torch's ``ZeroRedundancyOptimizer``) or ``fsdp2``.

Parameter sharding and CPU offload run on ``fsdp2`` (:mod:`ds_lightning.sharding.zero3`).
"""

from ds_lightning.sharding.fsdp2 import SHARDING_ENGINES, ShardingEngine, check_sharding_engine
from ds_lightning.sharding.zero import (
    check_shardable,
    check_sharding_options,
    consolidated_state,
    load_sharded_states,
    optimizer_state_bytes,
    shard_optimizer,
    shard_optimizers,
)
from ds_lightning.sharding.zero3 import ShardingEngineSetting, local_state_bytes, resolve_parameter_sharding

__all__ = [
    "SHARDING_ENGINES",
    "ShardingEngine",
    "ShardingEngineSetting",
    "check_shardable",
    "check_sharding_engine",
    "check_sharding_options",
    "consolidated_state",
    "load_sharded_states",
    "local_state_bytes",
    "optimizer_state_bytes",
    "resolve_parameter_sharding",
    "shard_optimizer",
    "shard_optimizers",
]
