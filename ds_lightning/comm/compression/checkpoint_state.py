"""Gradient compression's per-rank state (PowerSGD's error feedback, auto's choice) in ds_mirrored's checkpoints.

The state differs per rank, and the run resumes exactly only when each rank gets its own back:

- a full checkpoint (one file) gathers every rank's state into ``checkpoint["ds_mirrored"]["compression_states"]``;
- a sharded one (``state_dict_type="sharded"``) has each rank write its own with DCP, under
  ``"ds_mirrored_compression" / "rank_<r>"``, so nothing is gathered on rank 0; ``meta.pt`` records only the setting
  and the world size. Lightning's ``consolidate_checkpoint`` turns the parts into
  ``checkpoint["ds_mirrored_compression"]``, which a full-checkpoint resume reads too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ds_lightning.checkpoint.io import ShardedGroup, load_rank_state
from ds_lightning.checkpoint.layout import PerRankState, SavedShards, rank_key
from ds_lightning.comm.compression.compressor import GradientCompressor

__all__ = ["CHECKPOINT_KEY", "PARTS_KEY", "add_compression_state", "load_compression_state"]

#: The entry in Lightning's checkpoint dict (meta.pt in a sharded folder): the setting, the world size, and in a full
#: checkpoint every rank's state.
CHECKPOINT_KEY = "ds_mirrored"
#: A sharded checkpoint's per-rank parts (a key of the DCP files).
PARTS_KEY = "ds_mirrored_compression"


def add_compression_state(
    checkpoint: dict[str, Any], compressor: GradientCompressor, setting: str, sharded: bool
) -> None:
    """Put this rank's compression state into ``checkpoint``; collective over the default group for a full one."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    saved: dict[str, Any] = {"gradient_compression": setting, "world_size": world_size}
    if sharded:
        checkpoint[PARTS_KEY] = PerRankState(rank, compressor.state_dict())
    else:
        states: list[Any] = [None] * world_size
        dist.all_gather_object(states, compressor.state_dict())
        saved["compression_states"] = states
    checkpoint[CHECKPOINT_KEY] = saved


def load_compression_state(
    checkpoint: dict[str, Any],
    compressor: GradientCompressor,
    setting: str,
    group: ShardedGroup,
    device: torch.device | None = None,
) -> None:
    """Restore this rank's state from a full file, a sharded folder or a consolidated file; warn when there is none.

    Collective over ``group`` for a sharded folder (every rank reads its own part), decided alike on every rank.

    Raises:
        RuntimeError: when the checkpoint records the state for this world size but holds no part for this rank.

    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None or saved.get("gradient_compression") != setting:
        rank_zero_warn(
            f"The checkpoint holds no gradient_compression={setting!r} state; PowerSGD's error feedback starts from"
            " zero (and auto from its set-up decision)."
        )
        return
    if saved["world_size"] != world_size:
        rank_zero_warn(
            f"The checkpoint's compression state is for {saved['world_size']} ranks, this run has {world_size}; error"
            " feedback starts from zero."
        )
        return
    parts = checkpoint.get(PARTS_KEY)
    if "compression_states" in saved:
        state = saved["compression_states"][rank]
    elif isinstance(parts, SavedShards):
        state = load_rank_state(parts, rank, group)
    else:  # consolidated by Lightning's consolidate_checkpoint: every rank's part, keyed by rank
        state = (parts or {}).get(rank_key(rank))
    if state is None:
        raise RuntimeError(
            f"The checkpoint records gradient_compression={setting!r} state for {world_size} ranks but holds none for"
            f" rank {rank}: it is incomplete; resume from another checkpoint."
        )
    compressor.load_state_dict(state, device=device)
