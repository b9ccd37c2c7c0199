"""Optimizer-state sharding (ZeRO stage 1) for ``ds_mirrored``, on torch's ``ZeroRedundancyOptimizer``."""

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
    "check_shardable",
    "check_sharding_options",
    "consolidated_state",
    "load_sharded_states",
    "optimizer_state_bytes",
    "shard_optimizer",
    "shard_optimizers",
]
