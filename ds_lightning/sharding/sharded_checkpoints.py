"""ZeRO-1's part of a sharded checkpoint (``state_dict_type="sharded"``): each rank writes and reads its own partition.

torch's ``ZeroRedundancyOptimizer`` keeps each parameter's optimizer state on one rank (its local ``optim``). In a
sharded checkpoint (:mod:`ds_lightning.checkpoint`) every rank answers with only the state it owns, keyed by parameter
FQN, plus the full ``param_groups`` (identical on every rank, so DCP writes them once): nothing is consolidated on
rank 0, and the keys are the ones ``get_optimizer_state_dict`` uses for FSDP2, so a folder written by either engine, at
any world size, loads under the other.

On load each rank builds targets for the FQNs it owns now, with the names, shapes and dtypes the folder's metadata
records (zero tensors: creating the state by a step would run ZeRO's collectives and count as a step), reads them with
:func:`~ds_lightning.checkpoint.io.load_into` (DCP reshards) and hands them to its local optimizer partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from ds_lightning.checkpoint.io import ShardedGroup, load_into
from ds_lightning.checkpoint.layout import SavedShards, saved_entries
from ds_lightning.sharding.zero import load_sharded_states

__all__ = ["load_zero_partitions", "owned_targets", "zero_partition_state"]


def _unwrap(optimizer: Optimizer) -> Optimizer:
    while hasattr(optimizer, "_optimizer"):  # Lightning's LightningOptimizer
        optimizer = optimizer._optimizer
    return optimizer


def _names(module: nn.Module, optimizer: ZeroRedundancyOptimizer) -> dict[torch.Tensor, str]:
    names: dict[torch.Tensor, str] = {param: name for name, param in module.named_parameters()}
    outside = sum(param not in names for group in optimizer.param_groups for param in group["params"])
    if outside:
        raise ValueError(
            f"{outside} of the parameters {type(optimizer.optim).__name__} steps are not in the LightningModule, and a"
            " sharded checkpoint keys optimizer state by parameter name: give configure_optimizers the module's own"
            " parameters (self.parameters()), or use state_dict_type='full'."
        )
    return names


def zero_partition_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's partition of a ZeRO-1 optimizer's state, keyed by FQN over ``module``, with every param group.

    No collective: each rank answers with what it owns (the layout of ``get_optimizer_state_dict``, restricted to the
    owned parameters' state). The tensors are the live ones, as the protocol's defaults return them.

    Raises:
        ValueError: when the optimizer steps parameters outside ``module``, naming the count and the fix.

    """
    raw = _unwrap(optimizer)
    assert isinstance(raw, ZeroRedundancyOptimizer)
    names = _names(module, raw)
    state = {names[param]: dict(values) for param, values in raw.optim.state.items() if values}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
        for group in raw.param_groups  # the wrapper's groups: all parameters, hyperparameters synced after each step
    ]
    return {"state": state, "param_groups": groups}


def owned_targets(source: SavedShards, owned: set[str]) -> dict[str, Any]:
    """What this rank reads of ``source``: the owned FQNs' state and every param group's entries."""
    state: dict[str, dict[str, Any]] = {}
    groups: dict[int, dict[str, Any]] = {}
    for path, placeholder in saved_entries(source):
        if path[0] == "state" and len(path) == 3 and path[1] in owned:
            state.setdefault(str(path[1]), {})[str(path[2])] = placeholder
        elif path[0] == "param_groups" and len(path) == 3:
            groups.setdefault(int(path[1]), {})[str(path[2])] = placeholder
    if sorted(groups) != list(range(len(groups))):
        raise RuntimeError(f"{source.path}: {source.key}'s param groups {sorted(groups)} are not numbered 0..n-1.")
    return {"state": state, "param_groups": [groups[i] for i in range(len(groups))]}


def _as_numbered(
    loaded: dict[str, Any], names: dict[torch.Tensor, str], optimizer: ZeroRedundancyOptimizer, source: SavedShards
) -> dict[str, Any]:
    """The loaded part in the wrapper's own ``state_dict()`` layout (parameters numbered in group order)."""
    current = [[names[p] for p in group["params"]] for group in optimizer.param_groups]
    saved = [list(group.get("params", [])) for group in loaded["param_groups"]]
    if saved != current:
        raise RuntimeError(
            f"{source.path} holds {source.key} for param groups of {[len(g) for g in saved]} parameters"
            f" ({sum(map(len, saved))} names), but this optimizer has groups of {[len(g) for g in current]} with other"
            " names or order: resume with the model and configure_optimizers that wrote the checkpoint."
        )
    index = {name: i for i, name in enumerate(name for group in current for name in group)}
    groups = []
    for group, hyper in zip(optimizer.param_groups, loaded["param_groups"], strict=True):
        options = {k: v for k, v in hyper.items() if k != "params"}
        groups.append({**options, "params": [index[names[p]] for p in group["params"]]})
    return {"state": {index[name]: values for name, values in loaded["state"].items()}, "param_groups": groups}


def load_zero_partitions(
    module: nn.Module, optimizers: Sequence[Optimizer], sources: Sequence[SavedShards], group: ShardedGroup
) -> None:
    """Load each ZeRO-1 optimizer's state from its part of a sharded folder; each rank reads only what it owns.

    The folder may come from any engine (ZeRO-1, FSDP2, a replicated run) and any world size: the keys are FQNs, and
    DCP reads the pieces of each owned tensor. Collective over ``group`` (one DCP load per optimizer, every rank).

    Raises:
        RuntimeError: when the checkpoint holds another number of optimizers, or other parameters, naming both.

    """
    if len(sources) != len(optimizers):
        raise RuntimeError(
            f"The checkpoint holds {len(sources)} optimizer state(s), but configure_optimizers returned"
            f" {len(optimizers)}: resume with the optimizers that wrote it."
        )
    for optimizer, source in zip(optimizers, sources, strict=True):
        raw = _unwrap(optimizer)
        assert isinstance(raw, ZeroRedundancyOptimizer)
        names = _names(module, raw)
        owned = {names[param] for group in raw.optim.param_groups for param in group["params"]}
        targets = {source.key: owned_targets(source, owned)}
        load_into(targets, source.path, group)
        load_sharded_states([raw], [_as_numbered(targets[source.key], names, raw, source)])
