"""How ``ds_parameter_server``'s chief writes and reads checkpoints.

The servers hold the optimizer, so a checkpoint carries their state consolidated into one ordinary optimizer state
dict (:mod:`ds_lightning.parameter_server.checkpoint` defines the layout), and a restore hands it back to the servers
when training starts.

With ``state_dict_type="sharded"`` the chief writes the same state as a sharded folder (Lightning FSDP's layout, see
:mod:`ds_lightning.checkpoint`), alone and with no collective (the workers hold nothing the chief lacks, the servers
are not in the workers' process group): parameters and the optimizer state keyed by parameter name, so the folder
resumes at another number of servers, or consolidated into one file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning.checkpoint.io import ShardedGroup
from ds_lightning.checkpoint.layout import SavedShards, read_part
from ds_lightning.checkpoint.options import StateDictType
from ds_lightning.checkpoint.strategy_hooks import sharded_parts
from ds_lightning.parameter_server.checkpoint import ConsolidatedRun, ResumePoint, ShardState, consolidate
from ds_lightning.parameter_server.client import ServerClient
from ds_lightning.parameter_server.sharding import ParameterShardPlan
from ds_lightning.sharding.optimizer_layout import index_by_name, named_state, numbered_state

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _StrategyBase
else:  # at run time a plain mixin, placed before the strategy's base in its MRO
    _StrategyBase = object

__all__ = ["ChiefCheckpoints"]


class ChiefCheckpoints(_StrategyBase):
    """Mixin for ``ParameterServerStrategy``: the checkpoint hooks of the chief (global rank 0).

    The strategy provides ``num_servers``, ``num_workers`` and ``max_staleness`` and keeps the attributes below:
    ``_client`` while connected to the servers, ``_final_state`` (the servers' state read once training ended, when
    they are gone), ``_finished`` and ``_resume`` (the state a restore hands to the servers).
    """

    num_servers: int
    max_staleness: int | None
    state_dict_type: StateDictType
    _client: ServerClient | None
    _plan: ParameterShardPlan | None
    _params: dict[str, Tensor]
    _finished: bool
    _final_state: ConsolidatedRun | None
    _resume: ResumePoint | None

    @property
    def num_workers(self) -> int:
        """Training processes in the run."""
        raise NotImplementedError

    def _index_of(self) -> dict[str, int]:
        assert self.lightning_module is not None
        return index_by_name(self.lightning_module, self.optimizers[0])

    def _consolidated_state(self, shards: list[ShardState] | None = None) -> ConsolidatedRun:
        assert self._client is not None and self._plan is not None
        run = {"num_servers": self.num_servers, "num_workers": self.num_workers, "max_staleness": self.max_staleness}
        shards = shards if shards is not None else self._client.state()
        return consolidate(shards, self._plan, self._params, self.optimizers[0], self._index_of(), run)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.is_global_zero and (self._client is not None or self._final_state is not None):
            state = self._final_state if self._finished else self._consolidated_state()
            if state is not None:
                state.write_into(checkpoint, final_params=self._params if self._finished else None)
                if self.state_dict_type == "sharded":  # keyed by name: the layout of every sharded checkpoint
                    checkpoint["optimizer_states"] = [self._by_name(state.optimizer_state)]
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _by_name(self, state: dict[str, Any]) -> dict[str, Any]:
        assert self.lightning_module is not None
        return named_state(state, self.lightning_module, self.optimizers[0])

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # The servers hold the optimizer; the chief hands them this state when training starts.
        parts = sharded_parts(checkpoint, "optimizer_states")
        if parts is not None:
            # Only the chief starts the servers: it reads the state whole, as it would gather it from them anyway.
            states = [numbered_state(read_part(parts[0]))] if self.is_global_zero else []
            checkpoint = {**checkpoint, "optimizer_states": states}
        self._resume = ResumePoint.from_checkpoint(checkpoint)

    # --- the sharded-checkpoint protocol (ds_lightning.checkpoint.protocol) --------------------------------------

    def sharded_checkpoint_group(self) -> ShardedGroup:
        """The chief saves alone, with no collective; every process loads the model on its own."""
        return ShardedGroup(saves=self.is_global_zero, no_dist=True, coordinator=True)

    def sharded_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The worker's own (never stepped) optimizer by name; the chief's save puts the servers' state in its place.

        No step with zero gradients to create state, as the default does: the servers hold it.
        """
        return self._by_name(getattr(optimizer, "_optimizer", optimizer).state_dict())

    def load_sharded_optimizer_states(self, sources: Sequence[SavedShards]) -> None:
        """Not used: :meth:`load_optimizer_state_dict` hands the state to the servers."""
        raise NotImplementedError("ds_parameter_server's servers hold the optimizer; see load_optimizer_state_dict")
