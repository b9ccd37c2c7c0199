"""Parameter sharding (ZeRO stage 3) for ``MirroredStrategy(shard_parameters=True)``, on the fsdp2 engine.

``shard_parameters=True`` runs :func:`ds_lightning.sharding.fsdp2.shard_module` with
``reshard_after_forward=True``: every unit frees its gathered parameters after its forward and gathers them again
in the backward, so between uses each rank holds 1/N of the parameters, of the gradients (reduce-scattered) and of
the optimizer state (which steps the shards). This module holds what that adds to the engine:

- :func:`resolve_parameter_sharding`: how ``shard_parameters`` and ``cpu_offload`` combine with
  ``shard_optimizer_state`` and ``sharding_engine`` (checked at construction);
- :func:`parameter_units`: finer units than :func:`~ds_lightning.sharding.fsdp2.shard_units` (each block of a layer
  stack found at any depth, so one block at a time is gathered), never splitting a tied parameter's users;
- :func:`fully_shard_policies`: torch's ``MixedPrecisionPolicy`` under ``bf16-mixed`` and ``CPUOffloadPolicy``;
- :func:`local_state_bytes`: what one rank holds (parameters, gradients, optimizer state), read from local shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from ds_lightning import _validation as check

__all__ = [
    "ShardingEngineSetting",
    "fully_shard_policies",
    "local_state_bytes",
    "parameter_units",
    "resolve_parameter_sharding",
]

#: ``MirroredStrategy(sharding_engine=...)``; ``"auto"``: ``"fsdp2"`` under ``shard_parameters=True``, else ``"zero"``.
ShardingEngineSetting = Literal["auto", "zero", "fsdp2"]
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def resolve_parameter_sharding(
    shard_parameters: object, cpu_offload: object, shard_optimizer_state: Any, sharding_engine: Any
) -> tuple[Any, Any]:
    """Check ``shard_parameters`` and ``cpu_offload``; return the ``(shard_optimizer_state, sharding_engine)`` to run.

    ``shard_parameters=True`` shards the optimizer state too (it steps the parameter shards), on the fsdp2 engine;
    ``sharding_engine="auto"`` resolves to ``"fsdp2"`` then, and to ``"zero"`` otherwise. Any other engine value is
    returned as given, for :func:`~ds_lightning.sharding.fsdp2.check_sharding_engine` to judge, and so is a
    ``shard_optimizer_state`` that is not a bool, for :func:`~ds_lightning.sharding.zero.check_sharding_options`.

    Raises:
        ValueError: for a flag that is not a bool, ``cpu_offload=True`` without ``shard_parameters=True``, or
            ``shard_parameters=True`` with ``sharding_engine="zero"`` (ZeRO-1 never splits parameters).

    """
    check.flag("shard_parameters", shard_parameters)
    check.flag("cpu_offload", cpu_offload)
    if cpu_offload and not shard_parameters:
        raise ValueError(
            "cpu_offload=True keeps the sharded parameters and optimizer state in host memory, which needs them"
            " sharded: set shard_parameters=True with it, e.g. MirroredStrategy(shard_parameters=True,"
            " cpu_offload=True), or drop cpu_offload."
        )
    if sharding_engine == "auto":
        sharding_engine = "fsdp2" if shard_parameters else "zero"
    elif shard_parameters and sharding_engine == "zero":
        raise ValueError(
            "shard_parameters=True splits every parameter with torch's fully_shard (the fsdp2 engine), but"
            " sharding_engine='zero' (ZeRO stage 1) keeps whole parameters on every rank: drop sharding_engine (or"
            " set sharding_engine='fsdp2'), or set shard_parameters=False to keep the zero engine."
        )
    if shard_parameters and isinstance(shard_optimizer_state, bool):
        shard_optimizer_state = True  # the optimizer steps the parameter shards: its state is sharded with them
    return shard_optimizer_state, sharding_engine


def _owners(root: nn.Module) -> dict[int, set[str]]:
    """For each parameter (by identity), the qualified names of every module that registers it (two when tied)."""
    owners: dict[int, set[str]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return owners


def _closed(prefix: str, module: nn.Module, owners: dict[int, set[str]]) -> bool:
    """Whether every user of every parameter in ``module`` lies inside it: it can be a unit of its own."""
    below = f"{prefix}."
    return all(
        all(name == prefix or name.startswith(below) for name in owners[id(param)]) for param in module.parameters()
    )


def _holds_stack(module: nn.Module) -> bool:
    return any(isinstance(m, _CONTAINERS) and next(m.parameters(), None) is not None for m in module.modules())


def parameter_units(root: nn.Module) -> list[nn.Module]:
    """The modules to shard as units before ``root`` under ``shard_parameters=True``, in module order.

    Walking down from ``root``: a container (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) gives each
    member as a unit (a transformer block, a GPT-2 ``GPT2Block``); a module that holds a container further down is
    walked into (its own leftovers stay with the root, which gathers them once); any other module with parameters is
    a unit. A candidate is a unit only if it holds every user of its parameters: a head tied to the token embedding
    (two modules, one parameter) leaves both in the root, which must own a parameter that two units would split.
    """
    owners = _owners(root)
    units: list[nn.Module] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if next(child.parameters(), None) is None:
                continue
            if isinstance(module, _CONTAINERS) and _closed(path, child, owners):
                units.append(child)  # a member of a layer stack: one block at a time is gathered
            elif isinstance(child, _CONTAINERS) or _holds_stack(child) or not _closed(path, child, owners):
                visit(path, child)
            else:
                units.append(child)

    visit("", root)
    return units


def fully_shard_policies(
    precision: str, device: torch.device, cpu_offload: bool
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The ``fully_shard`` policies for a run in Lightning's ``precision`` on ``device``.

    Under ``"bf16-mixed"`` the units gather bf16 parameters and reduce-scatter fp32 gradients: the all-gather moves
    half the bytes, and Lightning's autocast, which stays on around the step (its fp32 ops, such as the loss, keep
    their precision), finds the matmul weights already bf16 and casts nothing, instead of casting each gathered fp32
    weight again in every op that uses it. The sharded parameters, their gradients and the optimizer stay fp32.
    Other precisions gather the parameters as they are stored (``"bf16-true"`` has converted them already).

    ``cpu_offload`` keeps the sharded parameters, gradients and optimizer state in host memory (pinned on CUDA only:
    pinning needs an accelerator).
    """
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    return (mixed if precision == "bf16-mixed" else MixedPrecisionPolicy()), offload


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensors: Iterable[Any]) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def local_state_bytes(module: nn.Module, optimizers: Iterable[Optimizer]) -> dict[str, int]:
    """Bytes this rank holds of ``module``'s parameters and gradients and of the optimizers' state (local shards).

    Read between steps (after the optimizer step, before the next forward), when a parameter-sharded model holds only
    its shards. Tied parameters count once.
    """
    params = list(module.parameters())  # deduplicated: a tied parameter once
    state = [
        value
        for optimizer in optimizers
        for per_param in getattr(optimizer, "_optimizer", optimizer).state.values()
        for value in per_param.values()
    ]
    return {
        "parameters": _nbytes(params),
        "gradients": _nbytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": _nbytes(state),
    }
