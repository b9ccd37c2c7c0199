"""Optimizer-state sharding for ``ds_mirrored``: ``zero`` (torch's ``ZeroRedundancyOptimizer``) or ``fsdp2``."""

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

__all__ = [
    "SHARDING_ENGINES",
    "ShardingEngine",
    "check_shardable",
    "check_sharding_engine",
    "check_sharding_options",
    "consolidated_state",
    "load_sharded_states",
    "optimizer_state_bytes",
    "shard_optimizer",
    "shard_optimizers",
]
