"""The FSDP2 engine of ``MirroredStrategy(shard_optimizer_state=True, sharding_engine="fsdp2")``.

torch's ``fully_shard(reshard_after_forward=False)`` replaces DDP: every parameter is a ``DTensor`` sharded along its
first dimension over all ranks (a 1-D ``DeviceMesh`` on the default process group), so each rank keeps and steps 1/N of
every parameter's optimizer state, not 1/N of the parameters picked whole as ZeRO-1 does. Each step all-gathers the
parameters once (in the forward; they stay whole through the backward) and reduce-scatters the gradients once, in
place of DDP's all-reduce and ZeRO's broadcasts. ``shard_parameters=True`` (:mod:`ds_lightning.sharding.zero3`) runs
the same engine with finer units that free their parameters after the forward and gather them again in the backward.

Wrapping (:func:`shard_module`): each :func:`shard_units` module, then the LightningModule itself (the root, which
owns any parameters left over and must run its forward hooks first: the strategy routes ``training_step`` and the
other steps through the root's ``__call__``, as Lightning does for a DDP wrapper).

Checkpoints stay the plain ones: :func:`full_model_state` and :func:`full_optimizer_state` gather the whole state on
rank 0 with ``torch.distributed.checkpoint.state_dict`` (collectives every rank must call), the optimizer's in a
single-process ``state_dict()`` layout of :mod:`ds_lightning.sharding.optimizer_layout`;
:func:`load_full_model_state` and :func:`load_full_optimizer_states` take those layouts (from any engine and world
size) and keep this rank's shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.optim import Optimizer

from ds_lightning.sharding.optimizer_layout import named_state, numbered_state

__all__ = [
    "SHARDING_ENGINES",
    "ShardingEngine",
    "check_sharding_engine",
    "full_model_state",
    "full_optimizer_state",
    "is_fully_sharded",
    "load_full_model_state",
    "load_full_optimizer_states",
    "shard_module",
    "shard_units",
]

ShardingEngine = Literal["zero", "fsdp2"]
SHARDING_ENGINES = ("zero", "fsdp2")
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def check_sharding_engine(
    sharding_engine: object,
    shard_optimizer_state: bool,
    *,
    gradient_compression: str,
    ddp_comm_hook: object,
    hierarchical: object,
    model_averaging_period: object,
    shard_parameters: bool = False,
) -> str:
    """Validate ``sharding_engine`` against the strategy's other options, naming the bad value and the fix.

    ``sharding_engine`` and ``shard_optimizer_state`` are the values to run, after
    :func:`~ds_lightning.sharding.zero3.resolve_parameter_sharding` (``shard_parameters=True`` sets both).

    Returns:
        ``sharding_engine``.

    Raises:
        ValueError: for an unknown engine, ``"fsdp2"`` without ``shard_optimizer_state=True``, or ``"fsdp2"`` with an
            option that acts on DDP's gradient all-reduce, which FSDP2 replaces.

    """
    if sharding_engine not in SHARDING_ENGINES:
        raise ValueError(
            f"sharding_engine={sharding_engine!r} is not a choice: use 'zero' (torch's ZeroRedundancyOptimizer"
            " behind DDP), 'fsdp2' (torch's fully_shard) or 'auto' (fsdp2 under shard_parameters=True, else zero),"
            " e.g. MirroredStrategy(shard_optimizer_state=True, sharding_engine='fsdp2')."
        )
    if sharding_engine == "zero":
        return sharding_engine
    if not shard_optimizer_state:
        raise ValueError(
            "sharding_engine='fsdp2' picks how optimizer state is sharded, but shard_optimizer_state=False shards"
            " nothing: set shard_optimizer_state=True, or drop sharding_engine."
        )
    why = "FSDP2 replaces DDP, its gradient all-reduce and its comm hooks (it reduce-scatters gradients instead)"
    refused = (
        ("gradient_compression", gradient_compression, gradient_compression != "none", "gradient_compression='none'"),
        ("ddp_comm_hook", ddp_comm_hook, ddp_comm_hook is not None, "no ddp_comm_hook"),
        ("hierarchical", hierarchical, hierarchical is True, "hierarchical='auto' or False"),
        (
            "model_averaging_period",
            model_averaging_period,
            model_averaging_period is not None,
            "no model_averaging_period",
        ),
    )
    engine = "shard_parameters=True" if shard_parameters else "sharding_engine='fsdp2'"
    other = "shard_parameters=False and sharding_engine='zero'" if shard_parameters else "sharding_engine='zero'"
    for name, value, bad, keep in refused:
        if bad:
            raise ValueError(
                f"{engine} cannot run {name}={value!r}: {why}. Use {keep} with {engine}, or keep {name} with {other}."
            )
    return sharding_engine


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def shard_units(root: nn.Module) -> list[nn.Module]:
    """The modules :func:`shard_module` shards before the root, each its own all-gather and reduce-scatter group.

    Every child of ``root`` that holds parameters, except that a container child (``nn.Sequential``,
    ``nn.ModuleList``, ``nn.ModuleDict``) gives its own children that hold parameters: the demos' MLP gives its
    linear layers, the GPT its embedding, each transformer block, the last norm and the head.
    """
    units: list[nn.Module] = []
    for child in root.children():
        members = list(child.children()) if isinstance(child, _CONTAINERS) else [child]
        units += [member for member in members if _has_parameters(member)]
    return units


def is_fully_sharded(module: object) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (the root)."""
    return isinstance(module, FSDPModule)


def shard_module(
    module: nn.Module,
    device: torch.device,
    *,
    units: Sequence[nn.Module] | None = None,
    reshard_after_forward: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
) -> nn.Module:
    """Apply ``fully_shard`` to every unit (by default :func:`shard_units`), then to ``module`` (the root).

    Call on every rank of the default process group, after the module is on ``device`` and before its optimizers
    exist (they must hold the sharded parameters). Rank 0's parameters and buffers are broadcast first, as DDP does,
    so every rank shards the same model. In place; returns ``module`` (already sharded: unchanged).

    ``reshard_after_forward=True`` (parameter sharding, :mod:`ds_lightning.sharding.zero3`) applies to the units
    only: the root's parameters (embeddings, a tied head) are the first the backward needs, so freeing them after
    the forward would only gather them again at once; every unit, the root included, reshards after the backward.
    """
    if is_fully_sharded(module):
        return module
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mixed, offload = mp_policy or MixedPrecisionPolicy(), offload_policy or OffloadPolicy()
    for unit in shard_units(module) if units is None else units:
        fully_shard(
            unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mixed, offload_policy=offload
        )
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=mixed, offload_policy=offload)
    return module


# --- checkpoints --------------------------------------------------------------------------------------------------


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """The whole ``state_dict()`` of a sharded module on rank 0 (CPU tensors), ``{}`` elsewhere; every rank calls."""
    return get_model_state_dict(module, options=_FULL_ON_RANK0)


def load_full_model_state(module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> None:
    """Load a whole (plain) ``state_dict`` into a sharded module; every rank calls it with the same ``state``."""
    set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))


def full_optimizer_state(module: nn.Module, optimizer: Optimizer, writer: bool) -> dict[str, Any]:
    """The whole state of an optimizer over ``module``'s sharded parameters, on rank 0 (``writer``).

    In a single-process ``state_dict()`` layout; ``{}`` on other ranks. Every rank must call it (all-gathers).

    An optimizer that has not stepped yet gives its own (empty) ``state_dict()``: torch's gatherer would otherwise
    take a zero-learning-rate step to create the state, which would count as a step (Adam's bias correction).
    """
    while hasattr(optimizer, "_optimizer"):  # Lightning's LightningOptimizer
        optimizer = optimizer._optimizer
    if not optimizer.state:
        return optimizer.state_dict() if writer else {}
    state = get_optimizer_state_dict(module, optimizer, options=_FULL_ON_RANK0)
    return numbered_state(state) if writer else {}


def load_full_optimizer_states(
    module: nn.Module, optimizers: Sequence[Optimizer], states: Sequence[Mapping[str, Any]]
) -> None:
    """Load whole single-process optimizer states (from any engine or world size); each rank keeps its shards.

    Every rank calls it with the same ``states`` (Lightning loads the checkpoint on every rank).
    """
    for optimizer, state in zip(optimizers, states, strict=False):
        while hasattr(optimizer, "_optimizer"):
            optimizer = optimizer._optimizer
        if not state.get("state"):
            optimizer.load_state_dict(dict(state))  # nothing to shard: options (lr, betas) only
            continue
        named = named_state(state, module, optimizer)
        set_optimizer_state_dict(module, optimizer, named, options=StateDictOptions(full_state_dict=True))
