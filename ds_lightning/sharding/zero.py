"""ZeRO stage 1: every rank keeps and steps 1/N of the optimizer state; checkpoints hold the whole state.

Built on torch's :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`: parameters stay whole on every rank, each
parameter's optimizer state lives on one rank (a greedy partition by size), that rank updates the parameter and
broadcasts it to the others after the step. DDP's gradient all-reduce (and ds_mirrored's compression hooks) are
unchanged, which is why this composes with compression, accumulation and gradient clipping.

Checkpoints: :func:`consolidated_state` gathers the shards on rank 0 (a collective every rank must call, bounded by
the process group's timeout, which is the strategy's ``timeout``) into the layout of the wrapped optimizer's own
``state_dict()``; :func:`load_sharded_states` takes that layout (from a sharded or a plain run, of any world size)
and keeps this rank's part.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = [
    "check_shardable",
    "check_sharding_options",
    "consolidated_state",
    "load_sharded_states",
    "optimizer_state_bytes",
    "shard_optimizer",
    "shard_optimizers",
]

# Optimizers whose step may call the closure a data-dependent number of times: each rank's shard would decide
# differently, and the gradient all-reduce inside the closure would hang.
_CLOSURE_LOOPING: tuple[type[Optimizer], ...] = (torch.optim.LBFGS,)


def check_sharding_options(shard_optimizer_state: object, model_averaging_period: object) -> bool:
    """Validate ``shard_optimizer_state`` against the strategy's other options.

    Returns:
        ``shard_optimizer_state``.

    Raises:
        ValueError: for a value that is not a bool, or sharding combined with post-local SGD model averaging.

    """
    if not isinstance(shard_optimizer_state, bool):
        raise ValueError(
            f"shard_optimizer_state={shard_optimizer_state!r} must be True or False, e.g."
            " MirroredStrategy(shard_optimizer_state=True)."
        )
    if shard_optimizer_state and model_averaging_period is not None:
        raise ValueError(
            f"shard_optimizer_state=True and model_averaging_period={model_averaging_period!r}: post-local SGD"
            " averages models between optimizer steps that every rank takes whole, which a sharded optimizer cannot"
            " do; remove model_averaging_period or set shard_optimizer_state=False."
        )
    return shard_optimizer_state


def check_shardable(optimizer: Optimizer) -> None:
    """Refuse an optimizer that cannot be sharded, naming it and the fix.

    Raises:
        ValueError: for an optimizer whose step re-evaluates the closure (``LBFGS``), sparse parameters, or parameters
            of several dtypes or devices (torch's sharded optimizer needs one dense type).

    """
    name = type(optimizer).__name__
    if isinstance(optimizer, _CLOSURE_LOOPING):
        raise ValueError(
            f"shard_optimizer_state=True cannot shard {name}: its step calls the closure (forward, backward and the"
            " gradient all-reduce) a data-dependent number of times, and each rank would call it for its own shard;"
            " use a first-order optimizer such as Adam or SGD, or set shard_optimizer_state=False."
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kinds = sorted({f"{p.dtype} on {p.device}{' (sparse)' if p.is_sparse else ''}" for p in params})
    if len(kinds) > 1 or any(p.is_sparse for p in params):
        raise ValueError(
            f"shard_optimizer_state=True needs all of {name}'s parameters dense, of one dtype on one device, but they"
            f" are {kinds}; cast the model to one dtype (e.g. model.float()) or set shard_optimizer_state=False."
        )


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    # Every group already carries every option; pass on only the defaults the class's constructor accepts.
    parameters = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {key: value for key, value in optimizer.defaults.items() if key in parameters}


def shard_optimizer(optimizer: Optimizer) -> ZeroRedundancyOptimizer:
    """Wrap ``optimizer`` (its class, parameter groups and options) in a ``ZeroRedundancyOptimizer``.

    Call on every rank of the default process group, once the process group is up. Any state ``optimizer`` already
    holds is carried over (sharded).

    Raises:
        ValueError: see :func:`check_shardable`.

    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    check_shardable(optimizer)
    groups = [dict(group) for group in optimizer.param_groups]
    sharded = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **_constructor_defaults(optimizer))
    if optimizer.state:
        load_sharded_states([sharded], [optimizer.state_dict()])
    return sharded


def _mark_step_for_schedulers(optimizer: ZeroRedundancyOptimizer) -> None:
    # torch's LR schedulers mark the step of the optimizer they were built on, and warn at their first step when the
    # optimizer they point at lacks that mark; re-pointing them here must not look like a misordered loop.
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = type(optimizer).step
    owner = weakref.ref(optimizer)

    @functools.wraps(step)
    def counted_step(*args: Any, **kwargs: Any) -> Any:
        target = owner()
        assert target is not None  # the optimizer is alive: it is the one calling its step
        target._opt_called = True  # type: ignore[attr-defined]  # the mark torch's LR schedulers read
        return step(target, *args, **kwargs)

    counted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = counted_step  # type: ignore[method-assign]


def shard_optimizers(optimizers: Sequence[Optimizer], lr_scheduler_configs: Sequence[Any]) -> list[Optimizer]:
    """Wrap every optimizer (see :func:`shard_optimizer`) and point its LR schedulers at the wrapper.

    Args:
        optimizers: the optimizers Lightning built from ``configure_optimizers``.
        lr_scheduler_configs: Lightning's scheduler configs (anything with a ``scheduler`` attribute); a scheduler
            whose ``optimizer`` is one of ``optimizers`` is re-pointed, so its steps set the learning rate that the
            sharded step applies.

    Returns:
        The sharded optimizers, in the same order.

    """
    sharded: list[Optimizer] = []
    for optimizer in optimizers:
        wrapper = shard_optimizer(optimizer)
        for config in lr_scheduler_configs:
            scheduler = config.scheduler
            if getattr(scheduler, "optimizer", None) is optimizer and wrapper is not optimizer:
                scheduler.optimizer = wrapper
                _mark_step_for_schedulers(wrapper)
        sharded.append(wrapper)
    return sharded


def consolidated_state(optimizer: Optimizer, writer: bool) -> dict[str, Any]:
    """The whole optimizer state on rank 0, in the wrapped optimizer's own ``state_dict()`` layout.

    Every rank must call it (a gather of the shards over the default process group, which fails after the group's
    timeout instead of hanging). A plain optimizer's ``state_dict()`` is returned as it is.

    Args:
        optimizer: a sharded (or plain) optimizer.
        writer: whether this rank is global rank 0, the one that receives the state.

    Returns:
        The state on rank 0, ``{}`` elsewhere.

    """
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(to=0)
    if not writer:
        return {}
    state = optimizer.state_dict()
    # torch keeps the gathered shards until the next consolidation: a second copy of the state on rank 0.
    optimizer._all_state_dicts = []  # type: ignore[attr-defined]  # torch's private attribute, absent from its types
    state["state"] = {index: value for index, value in state["state"].items() if value is not None}
    return state


def load_sharded_states(optimizers: Sequence[Optimizer], states: Sequence[dict[str, Any]]) -> None:
    """Load whole optimizer states (a sharded or a plain run's, of any world size); each rank keeps its shard.

    The checkpoint's dicts are not changed (torch's loader blanks other ranks' entries in what it is given).
    """
    for optimizer, state in zip(optimizers, states, strict=False):
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.load_state_dict(state)
            continue
        optimizer.load_state_dict({**state, "state": dict(state["state"])})
        # The wrapper keeps its own copy of this rank's shard (the local optimizer holds the one that steps).
        optimizer.state.clear()


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds (ZeRO: its partition; FSDP2: its ``DTensor`` shards)."""
    while hasattr(optimizer, "_optimizer"):  # Lightning's LightningOptimizer
        optimizer = optimizer._optimizer
    state = optimizer.optim.state if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer.state
    local = (
        value.to_local() if isinstance(value, DTensor) else value
        for per_param in state.values()
        for value in (per_param.values() if isinstance(per_param, dict) else ())
    )
    return sum(value.numel() * value.element_size() for value in local if isinstance(value, torch.Tensor))
