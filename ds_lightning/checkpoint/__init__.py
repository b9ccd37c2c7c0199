"""Sharded checkpoints with ``torch.distributed.checkpoint``: each rank writes its part, in Lightning FSDP's layout.

- :mod:`~ds_lightning.checkpoint.options`: the ``state_dict_type`` option ("full" or "sharded");
- :mod:`~ds_lightning.checkpoint.layout`: the folder (DCP files plus ``meta.pt``), read back as a checkpoint dict;
- :mod:`~ds_lightning.checkpoint.io`: saving and loading it, and which ranks take part;
- :mod:`~ds_lightning.checkpoint.protocol`: what a strategy answers with (canonical FQN keys), and the defaults;
- :mod:`~ds_lightning.checkpoint.strategy_hooks`: the hooks ``ClusterStrategy`` dispatches through.
"""

from ds_lightning.checkpoint.io import ShardedGroup, ShardedWriter, load_into, save_sharded
from ds_lightning.checkpoint.layout import META_FILENAME, SavedShards, is_sharded_checkpoint, read_checkpoint, read_part
from ds_lightning.checkpoint.options import STATE_DICT_TYPES, StateDictType, check_state_dict_type
from ds_lightning.checkpoint.protocol import ShardedStateDicts
from ds_lightning.checkpoint.strategy_hooks import ShardedCheckpoints

__all__ = [
    "META_FILENAME",
    "STATE_DICT_TYPES",
    "SavedShards",
    "ShardedCheckpoints",
    "ShardedGroup",
    "ShardedStateDicts",
    "ShardedWriter",
    "StateDictType",
    "check_state_dict_type",
    "is_sharded_checkpoint",
    "load_into",
    "read_checkpoint",
    "read_part",
    "save_sharded",
]
