"""The state-dict protocol a strategy implements for sharded checkpoints, and its defaults.

A strategy answers, on every rank, with what that rank holds, keyed canonically (parameter FQNs as in the unsharded
model; optimizer state keyed by FQN), so a checkpoint loads at another world size and under another engine:

- :meth:`ShardedStateDicts.sharded_model_state`: ``{fqn: tensor}`` for what this rank holds: a replicated tensor
  (written once: DCP's planner dedups), a ``DTensor`` (written as its shards), or a tensor only this rank owns (a
  pipeline stage's parameters) under a key no other rank uses;
- :meth:`ShardedStateDicts.sharded_optimizer_state`: ``{"state": {fqn: {name: tensor}}, "param_groups": [{...,
  "params": [fqn, ...]}]}`` for one optimizer (``get_optimizer_state_dict``'s layout); a rank owning part of the state
  (a ZeRO-1 partition) returns its FQNs only; hyperparameters are replicated;
- :meth:`ShardedStateDicts.load_sharded_model_state` / :meth:`ShardedStateDicts.load_sharded_optimizer_states`: fill
  this rank's tensors from the folder (build the targets as for a save, :func:`~ds_lightning.checkpoint.io.load_into`
  them, set them);
- :meth:`ShardedStateDicts.sharded_checkpoint_group`: which ranks save, and over which group.

The defaults here serve a replicated model with plain optimizers, and modules sharded by FSDP2 (``fully_shard``):
``torch.distributed.checkpoint.state_dict`` handles both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from ds_lightning.checkpoint.io import ShardedGroup, load_into
from ds_lightning.checkpoint.layout import MODEL_KEY, SavedShards, holds_optimizer_state

__all__ = [
    "ShardedStateDicts",
    "load_module_state",
    "load_optimizer_states",
    "module_state",
    "optimizer_state_by_name",
]


@runtime_checkable
class ShardedStateDicts(Protocol):
    """What :class:`~ds_lightning.strategies.ClusterStrategy` asks of a strategy for ``state_dict_type="sharded"``."""

    def sharded_model_state(self) -> dict[str, Any]:
        """This rank's module state by FQN."""

    def sharded_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's state of ``optimizer``, keyed by FQN."""

    def load_sharded_model_state(self, source: SavedShards, strict: bool) -> None:
        """Load this rank's module state from ``source`` (the ``"model"`` part) in place."""

    def load_sharded_optimizer_states(self, sources: Sequence[SavedShards]) -> None:
        """Load each optimizer's state from its part (``"optimizer_{i}"``) in place."""

    def sharded_checkpoint_group(self) -> ShardedGroup:
        """Which ranks save and load, over which group."""


def _raw(optimizer: Optimizer) -> Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer wraps the torch one


def module_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s state by FQN: plain tensors of a replicated module, ``DTensor`` shards under FSDP2."""
    return get_model_state_dict(module)


def optimizer_state_by_name(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by FQN over ``module``, for a save.

    ``get_optimizer_state_dict`` gives an optimizer that has not stepped its state with a step of zero gradients at
    learning rate 0, and that step counts (Adam's ``step`` becomes 1, and its first real step then corrects its bias
    as a second). So for such an optimizer the state is dropped again, from the optimizer and from the save: the run
    goes on as without the save, and a resume from it starts the optimizer as fresh (see
    :func:`load_optimizer_states`).
    """
    raw = _raw(optimizer)
    stepped = any(raw.state.values())
    state = get_optimizer_state_dict(module, raw)
    if not stepped:
        raw.state.clear()
        state["state"] = {}
    return state


def load_module_state(module: nn.Module, source: SavedShards, group: ShardedGroup, strict: bool = True) -> None:
    """Load ``module``'s state from the folder: each rank reads the tensors it holds (collective over ``group``)."""
    targets = {MODEL_KEY: module_state(module)}
    load_into(targets, source.path, group)
    set_model_state_dict(module, targets[MODEL_KEY], options=StateDictOptions(strict=strict))


def load_optimizer_states(
    module: nn.Module, optimizers: Sequence[Optimizer], sources: Sequence[SavedShards], group: ShardedGroup
) -> None:
    """Load each optimizer's state from its part of the folder (collective over ``group``, one load per optimizer).

    Raises:
        RuntimeError: when the checkpoint holds another number of optimizers, naming both.

    """
    if len(sources) != len(optimizers):
        raise RuntimeError(
            f"The checkpoint holds {len(sources)} optimizer state(s), but configure_optimizers returned"
            f" {len(optimizers)}: resume with the optimizers that wrote it."
        )
    for optimizer, source in zip(optimizers, sources, strict=True):
        raw = _raw(optimizer)
        # Targets with the state created (by a zero-lr step, which set_optimizer_state_dict then overwrites), unless
        # the part was saved before any step and holds none: then the optimizer starts fresh, as the saved one was.
        target = get_optimizer_state_dict(module, raw)
        fresh = not holds_optimizer_state(source)
        if fresh:
            target["state"] = {}
        targets = {source.key: target}
        load_into(targets, source.path, group)
        set_optimizer_state_dict(module, raw, targets[source.key])
        if fresh:
            raw.state.clear()
