"""How ``ds_parameter_server``'s chief writes and reads checkpoints.

The servers hold the optimizer, so a checkpoint carries their state consolidated into one ordinary optimizer state
dict (:mod:`ds_lightning.parameter_server.checkpoint` defines the layout), and a restore hands it back to the servers
when training starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from typing_extensions import override

from ds_lightning.parameter_server.checkpoint import ConsolidatedRun, ResumePoint, ShardState, consolidate
from ds_lightning.parameter_server.client import ServerClient
from ds_lightning.parameter_server.sharding import ParameterShardPlan
from ds_lightning.sharding.optimizer_layout import index_by_name

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
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # The servers hold the optimizer; the chief hands them this state when training starts.
        self._resume = ResumePoint.from_checkpoint(checkpoint)
