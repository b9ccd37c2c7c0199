"""Consolidate per-stage optimizer states into the single-device format, and split them back.

A stage's optimizer only holds that stage's parameters, and torch numbers them 0..n-1 in its own order. Keying the
states by parameter name makes them stage-independent: the consolidated form numbers the names in full-model order
group by group, exactly as ``configure_optimizers`` on the whole model would, so a plain Trainer loads it and any stage
count can split it again.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

__all__ = [
    "consolidate",
    "full_group_names",
    "gather_full_groups",
    "gather_stages",
    "group_names",
    "localize",
    "merged_state_dict",
    "named_cpu_state",
    "named_state",
]


def named_state(optimizer: Optimizer, names: Mapping[nn.Parameter, str]) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` with parameter names instead of indices."""
    indexed = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    for group_state, group in zip(indexed["param_groups"], optimizer.param_groups, strict=True):
        for index, param in zip(group_state["params"], group["params"], strict=True):
            index_to_name[index] = names[param]
    groups = [{**g, "params": [index_to_name[i] for i in g["params"]]} for g in indexed["param_groups"]]
    state = {index_to_name[i]: s for i, s in indexed["state"].items()}
    return {"param_groups": groups, "state": state}


def group_names(optimizer: Optimizer, names: Mapping[nn.Parameter, str]) -> list[list[str]]:
    """The parameter names of each param group."""
    return [[names[p] for p in group["params"]] for group in optimizer.param_groups]


def full_group_names(per_stage: Sequence[Sequence[Sequence[str]]], order: Sequence[str]) -> list[list[str]]:
    """Union of every stage's group membership, each group in full-model order.

    Raises:
        ValueError: if stages disagree on the number of param groups.

    """
    counts = {len(groups) for groups in per_stage}
    if len(counts) != 1:
        raise ValueError(
            f"Pipeline stages built different numbers of optimizer param groups ({sorted(counts)}); "
            "configure_optimizers must create the same groups on every stage (an empty group is fine)."
        )
    position = {name: i for i, name in enumerate(order)}
    merged = []
    for g in range(counts.pop()):
        members = {name for groups in per_stage for name in groups[g]}
        merged.append(sorted(members, key=lambda n: position[n]))
    return merged


def consolidate(states: Sequence[Mapping[str, Any]], groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Merge named per-stage states into one indexed state dict for the whole model.

    Args:
        states: each stage's :func:`named_state`.
        groups: :func:`full_group_names`, which fixes the numbering.

    """
    state: dict[int, Any] = {}
    param_groups = []
    named = {name: s for stage in states for name, s in stage["state"].items()}
    index = 0
    for g, names in enumerate(groups):
        hyper = next((stage["param_groups"][g] for stage in states if stage["param_groups"][g]["params"]), None)
        hyper = dict(hyper if hyper is not None else states[0]["param_groups"][g])
        indices = []
        for name in names:
            if name in named:
                state[index] = named[name]
            indices.append(index)
            index += 1
        param_groups.append({**hyper, "params": indices})
    return {"state": state, "param_groups": param_groups}


def localize(
    full: Mapping[str, Any], groups: Sequence[Sequence[str]], local_groups: Sequence[Sequence[str]]
) -> dict[str, Any]:
    """Cut a stage's indexed state dict out of a consolidated (or single-device) one.

    Raises:
        ValueError: if the checkpoint's groups do not match the model's, naming both shapes.

    """
    sizes = [len(g["params"]) for g in full["param_groups"]]
    if sizes != [len(g) for g in groups]:
        raise ValueError(
            f"The checkpoint's optimizer has param groups of sizes {sizes}, but configure_optimizers on the whole "
            f"model gives {[len(g) for g in groups]}; the checkpoint was made with a different model or optimizer."
        )
    by_name: dict[str, Any] = {}
    for full_group, names in zip(full["param_groups"], groups, strict=True):
        for index, name in zip(full_group["params"], names, strict=True):
            if index in full["state"]:
                by_name[name] = full["state"][index]
    state: dict[int, Any] = {}
    param_groups = []
    index = 0
    for full_group, names in zip(full["param_groups"], local_groups, strict=True):
        indices = []
        for name in names:
            if name in by_name:
                state[index] = copy.copy(by_name[name])
            indices.append(index)
            index += 1
        param_groups.append({**full_group, "params": indices})
    return {"state": state, "param_groups": param_groups}


# --- across the processes of a run (collectives: every rank calls them) -----------------------------------------------


def gather_stages(obj: Any, world_size: int, pipeline_size: int) -> list[Any]:
    """Every pipeline rank's ``obj`` of replica 0; replicas hold identical copies, so these are the whole model's."""
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return [gathered[r] for r in range(pipeline_size)]


def merged_state_dict(local: Mapping[str, Any], world_size: int, pipeline_size: int) -> dict[str, Any]:
    """The unsplit model's state dict: every stage's entries (on the CPU), under the unsplit model's keys."""
    merged: dict[str, Any] = {}
    for part in gather_stages({k: v.detach().cpu() for k, v in local.items()}, world_size, pipeline_size):
        merged.update(part)
    return merged


def named_cpu_state(optimizer: Optimizer, names: Mapping[nn.Parameter, str]) -> dict[str, Any]:
    """:func:`named_state` with its tensors on the CPU, ready to gather."""
    named = named_state(optimizer, names)
    return {
        "param_groups": named["param_groups"],
        "state": {
            k: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
            for k, s in named["state"].items()
        },
    }


def gather_full_groups(
    optimizers: Sequence[Optimizer], names: Mapping[nn.Parameter, str], order: Sequence[str], world_size: int
) -> list[list[list[str]]]:
    """For each optimizer, :func:`full_group_names` over every process's groups."""
    local = [group_names(opt, names) for opt in optimizers]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local)
    return [full_group_names([stage[i] for stage in gathered], order) for i in range(len(optimizers))]
