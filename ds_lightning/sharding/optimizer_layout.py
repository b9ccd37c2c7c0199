"""The single-process optimizer layout every consolidated checkpoint uses, and the parameter names behind its numbers.

A plain optimizer's ``state_dict()`` numbers its parameters in the order of its param groups. Every engine that shards
optimizer state (ZeRO, FSDP2, the parameter servers) writes its checkpoint in that layout, so a checkpoint does not
depend on the engine or the world size; FSDP2 and the parameter servers hold their state by parameter name and convert
here, in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

__all__ = ["index_by_name", "named_state", "numbered_state", "parameter_names"]


def parameter_names(module: nn.Module, optimizer: Optimizer) -> list[str | None]:
    """The name in ``module`` of each parameter ``optimizer`` steps, in state-dict order (``None``: not in it)."""
    names = {param: name for name, param in module.named_parameters()}
    return [names.get(param) for group in optimizer.param_groups for param in group["params"]]


def index_by_name(module: nn.Module, optimizer: Optimizer) -> dict[str, int]:
    """Each parameter's number in ``optimizer``'s state dict, by its name in ``module``."""
    return {name: index for index, name in enumerate(parameter_names(module, optimizer)) if name is not None}


def numbered_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state as a single-process optimizer writes it: parameters numbered by group order."""
    ids: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        params = []
        for name in group["params"]:
            ids.setdefault(name, len(ids))
            params.append(ids[name])
        groups.append({**group, "params": params})
    return {"state": {ids[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def named_state(state: Mapping[str, Any], module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The inverse of :func:`numbered_state` for ``optimizer`` over ``module``'s parameters.

    Raises:
        ValueError: when the state covers other parameters than ``optimizer`` steps, or some are outside ``module``,
            naming both counts and the fix.

    """
    order = parameter_names(module, optimizer)
    saved = [index for group in state["param_groups"] for index in group["params"]]
    if None in order or len(saved) != len(order):
        raise ValueError(
            f"The checkpoint's optimizer state covers {len(saved)} parameters, but this optimizer steps {len(order)}"
            f" ({order.count(None)} of them outside the model): resume with the model and configure_optimizers that"
            " wrote the checkpoint."
        )
    by_index = dict(zip(saved, order, strict=True))
    groups = [{**group, "params": [by_index[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {by_index[i]: value for i, value in state["state"].items()}, "param_groups": groups}
