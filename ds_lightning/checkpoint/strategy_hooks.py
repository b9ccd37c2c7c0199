"""``ShardedCheckpoints``: the strategy hooks that dispatch Lightning's checkpoint calls to the sharded path.

Mixed into :class:`~ds_lightning.strategies.ClusterStrategy` (before ``DDPStrategy`` in its MRO). With
``state_dict_type="sharded"``:

- ``lightning_module_state_dict`` / ``optimizer_state`` (what Lightning's ``dump_checkpoint`` asks for) answer with
  this rank's canonical state (:class:`~ds_lightning.checkpoint.protocol.ShardedStateDicts`), so nothing is gathered;
- ``save_checkpoint`` writes the folder (:mod:`~ds_lightning.checkpoint.layout`) on every saving rank, through the
  ``checkpoint_io`` when it writes sharded checkpoints itself (the backups' asynchronous writer), else synchronously.

With either setting, ``load_checkpoint`` reads a sharded folder as a checkpoint dict whose tensor parts are
:class:`~ds_lightning.checkpoint.layout.SavedShards`, and ``load_model_state_dict`` / ``load_optimizer_state_dict``
load them in place when Lightning restores the model and the optimizers (before or after ``setup``, whichever the
strategy restores at).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning.checkpoint.io import ShardedGroup, ShardedWriter, save_sharded
from ds_lightning.checkpoint.layout import (
    SavedShards,
    is_sharded_checkpoint,
    read_checkpoint,
    remove_path,
    split_checkpoint,
)
from ds_lightning.checkpoint.options import StateDictType
from ds_lightning.checkpoint.protocol import (
    load_module_state,
    load_optimizer_states,
    module_state,
    optimizer_state_by_name,
)

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _StrategyBase
else:  # at run time a plain mixin, placed before the strategy's base in its MRO
    _StrategyBase = object

__all__ = ["ShardedCheckpoints", "sharded_parts"]


def sharded_parts(checkpoint: Mapping[str, Any], key: str) -> list[SavedShards] | None:
    """The :class:`SavedShards` standing for ``checkpoint[key]`` (a list for ``"optimizer_states"``), else ``None``."""
    value = checkpoint.get(key)
    if isinstance(value, SavedShards):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, SavedShards) for v in value):
        return list(value)
    return None


class ShardedCheckpoints(_StrategyBase):
    """Mixin: ``state_dict_type`` ("full" or "sharded") and the default :class:`ShardedStateDicts` protocol.

    The defaults serve a replicated model with plain optimizers (and FSDP2-sharded modules): every rank answers with
    the whole state, DCP writes each tensor once, spread over the ranks. A strategy whose ranks hold different parts
    overrides the protocol's methods (see :mod:`ds_lightning.checkpoint.protocol`).
    """

    state_dict_type: StateDictType = "full"

    # --- the protocol's defaults ------------------------------------------------------------------------------------

    def sharded_checkpoint_group(self) -> ShardedGroup:
        """Every rank of the default group saves and loads; rank 0 writes ``meta.pt``."""
        return ShardedGroup.every_rank(self.is_global_zero)

    def sharded_model_state(self) -> dict[str, Any]:
        """The module's state by FQN (the LightningModule's, not a wrapper's: canonical names)."""
        assert self.lightning_module is not None
        return module_state(self.lightning_module)

    def sharded_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s state keyed by FQN over the LightningModule."""
        assert self.lightning_module is not None
        return optimizer_state_by_name(self.lightning_module, optimizer)

    def load_sharded_model_state(self, source: SavedShards, strict: bool) -> None:
        """Load the module's state in place; collective over :meth:`sharded_checkpoint_group`."""
        assert self.lightning_module is not None
        load_module_state(self.lightning_module, source, self.sharded_checkpoint_group(), strict)

    def load_sharded_optimizer_states(self, sources: Sequence[SavedShards]) -> None:
        """Load every optimizer's state in place; collective over :meth:`sharded_checkpoint_group`."""
        assert self.lightning_module is not None
        load_optimizer_states(self.lightning_module, self.optimizers, sources, self.sharded_checkpoint_group())

    # --- Lightning's checkpoint hooks -------------------------------------------------------------------------------

    @property
    def _saves_sharded(self) -> bool:
        return self.state_dict_type == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._saves_sharded:
            return self.sharded_model_state()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._saves_sharded:
            return self.sharded_optimizer_state(optimizer)
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if not self._saves_sharded:
            if self.is_global_zero and is_sharded_checkpoint(filepath):
                remove_path(Path(filepath))  # a sharded folder of an earlier run under the file's name (as Lightning)
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}(state_dict_type='sharded').save_checkpoint(..., storage_options=...) is not"
                " supported: every rank writes its part with torch.distributed.checkpoint, not through a"
                " CheckpointIO; drop storage_options or use state_dict_type='full'."
            )
        group = self.sharded_checkpoint_group()
        if not group.saves:
            return
        state, meta = split_checkpoint(checkpoint)
        io = self.checkpoint_io
        if isinstance(io, ShardedWriter):
            io.save_sharded(state, meta, Path(filepath), group)
        else:
            save_sharded(state, meta, Path(filepath), group)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if is_sharded_checkpoint(checkpoint_path):
            return read_checkpoint(checkpoint_path, weights_only)
        if weights_only is None:  # Lightning before 2.6 neither passes nor takes it
            return super().load_checkpoint(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        parts = sharded_parts(checkpoint, "state_dict")
        if parts is None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        self.load_sharded_model_state(parts[0], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        parts = sharded_parts(checkpoint, "optimizer_states")
        if parts is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        self.load_sharded_optimizer_states(parts)
