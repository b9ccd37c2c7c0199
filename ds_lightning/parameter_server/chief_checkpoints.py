"""How ``ds_parameter_server``'s chief writes and reads checkpoints.

The servers hold the optimizer, so a checkpoint carries their state consolidated into one ordinary optimizer state
dict (:mod:`ds_lightning.parameter_server.checkpoint` defines the layout), and a restore hands it back to the servers
when training starts.

With ``state_dict_type="sharded"`` a checkpoint is a folder in Lightning FSDP's layout (see
:mod:`ds_lightning.checkpoint`), parameters and optimizer state keyed by parameter name, so it resumes at another
number of servers, or consolidated into one file. While the servers run, each writes its own rows
(:mod:`~ds_lightning.parameter_server.server_checkpoint`) and the chief only adds ``meta.pt``: nothing is gathered.
After ``fit`` the servers are gone, and the chief writes the state they handed over at the end, alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning.checkpoint.io import ShardedGroup
from ds_lightning.checkpoint.layout import MODEL_KEY, SavedShards, read_part
from ds_lightning.checkpoint.options import StateDictType
from ds_lightning.checkpoint.strategy_hooks import sharded_parts
from ds_lightning.parameter_server.checkpoint import (
    CHECKPOINT_KEY,
    ConsolidatedRun,
    ResumePoint,
    ServerProgress,
    ShardState,
    consolidate,
)
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

    @property
    def _servers_write(self) -> bool:
        """Whether the servers write a sharded checkpoint's tensors now (they run, and the chief talks to them)."""
        return self.state_dict_type == "sharded" and self._client is not None and not self._finished

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.is_global_zero and self._servers_write:
            # The servers write the parameters and the optimizer state: keep only what they do not hold.
            assert self._plan is not None
            held = {piece.name for piece in self._plan.slices}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in held}
            checkpoint["optimizer_states"] = []
        elif self.is_global_zero and (self._client is not None or self._final_state is not None):
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
        """The chief saves (through the servers while they run) with no collective; every process loads on its own."""
        writer = self._write_on_servers if self._servers_write else None
        return ShardedGroup(saves=self.is_global_zero, no_dist=True, coordinator=True, remote_writer=writer)

    def _write_on_servers(self, state: dict[str, Any], folder: Path) -> dict[str, Any]:
        """Have the servers write the folder's DCP files with the chief's ``state``; ``meta.pt``'s progress entries."""
        assert self._client is not None and self.lightning_module is not None
        groups = self._by_name(self.optimizers[0].state_dict())["param_groups"]
        names = [list(group["params"]) for group in groups]
        chief_model = {name: value.detach().cpu() for name, value in state.get(MODEL_KEY, {}).items()}
        first = ShardState.from_message(self._client.save(str(folder), names, chief_model)[0], [torch.empty(0)])
        progress = ServerProgress(
            **first.progress.to_dict(),
            num_servers=self.num_servers,
            num_workers=self.num_workers,
            max_staleness=self.max_staleness,
        )
        return {"lr_schedulers": first.schedulers, CHECKPOINT_KEY: progress.to_dict()}

    def sharded_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The worker's own (never stepped) optimizer by name; the chief's save puts the servers' state in its place.

        No step with zero gradients to create state, as the default does: the servers hold it.
        """
        return self._by_name(getattr(optimizer, "_optimizer", optimizer).state_dict())

    def load_sharded_optimizer_states(self, sources: Sequence[SavedShards]) -> None:
        """Not used: :meth:`load_optimizer_state_dict` hands the state to the servers."""
        raise NotImplementedError("ds_parameter_server's servers hold the optimizer; see load_optimizer_state_dict")
