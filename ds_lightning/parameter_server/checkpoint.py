"""Checkpoints: the servers' shards consolidated into one Lightning checkpoint, and split again on resume.

A checkpoint holds the parameters and the optimizer state as one process would have them, so a plain Trainer (or a
run with another number of servers) resumes from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from ds_lightning.parameter_server.client import ServerClient
from ds_lightning.parameter_server.optimizer_shard import consolidate_state, split_full_state
from ds_lightning.parameter_server.server_loop import jsonable
from ds_lightning.parameter_server.sharding import ParameterShardPlan

CHECKPOINT_KEY = "ds_parameter_server"


def index_of(module: nn.Module, optimizer: Optimizer) -> dict[str, int]:
    """Each parameter's index in ``optimizer``'s state dict, by the parameter's name in ``module``."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {name_of[id(p)]: i for i, p in enumerate(params)}


def resume_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What the chief hands the servers when training starts from ``checkpoint``."""
    states = checkpoint.get("optimizer_states") or []
    return {
        "optimizer_state": states[0] if states else None,
        "lr_schedulers": checkpoint.get("lr_schedulers", []),
        "progress": checkpoint.get(CHECKPOINT_KEY),
        "global_step": checkpoint.get("global_step", 0),
    }


def initial_server_states(
    plan: ParameterShardPlan, num_servers: int, resume: Mapping[str, Any], index: dict[str, int], epoch: int
) -> tuple[list[Any], dict[str, Any]]:
    """Each server's piece of a resumed optimizer state, and the header every server starts from."""
    full_state = resume.get("optimizer_state")
    shard_states = [
        split_full_state(plan, s, full_state, index) if full_state else ([], []) for s in range(num_servers)
    ]
    saved = resume.get("progress") or {}
    extra = {
        "updates": int(saved.get("updates", resume.get("global_step", 0))),
        "epoch": epoch,
        "param_groups": [jsonable({k: v for k, v in g.items() if k != "params"}) for g in full_state["param_groups"]]
        if full_state
        else [],
        "schedulers": jsonable(resume.get("lr_schedulers", [])),
    }
    return shard_states, extra


def consolidated_state(
    client: ServerClient,
    plan: ParameterShardPlan,
    params: Mapping[str, Tensor],
    optimizer: Optimizer,
    index: dict[str, int],
    progress: dict[str, Any],
    replies: list[tuple[dict[str, Any], list[Tensor]]] | None = None,
) -> dict[str, Any]:
    """Ask every server for its shard; return the parameters, optimizer state, schedulers and progress of the run.

    Args:
        client: the worker's connection to the servers.
        plan: which server holds what.
        params: the worker's parameters (their shapes, and values for what no server holds).
        optimizer: the worker's optimizer, whose param groups the state dict takes.
        index: each parameter's index in the optimizer state (:func:`index_of`).
        progress: extra fields for the checkpoint's progress entry (servers, workers, staleness bound).
        replies: the servers' states when already fetched (the final ones come with ``done``); else asked for.

    """
    if replies is None:
        replies = client.state()
    values = {n: p.detach().clone() for n, p in params.items()}
    shards = []
    for server, (header, tensors) in enumerate(replies):
        plan.unflatten_into(tensors[0], server, values)
        shards.append((header["state_entries"], tensors[1 : 1 + int(header["n_state"])]))
    first = replies[0][0]
    groups = optimizer.state_dict()["param_groups"]
    for group, hyper in zip(groups, first["param_groups"], strict=True):
        group.update(hyper)
    shapes = {n: p.shape for n, p in params.items()}
    optimizer_state = consolidate_state(plan, shards, shapes, index, groups)
    saved = {k: first[k] for k in ("updates", "version", "epoch", "clocks", "worker_progress", "lost")}
    saved.update(progress)
    return {
        "params": values,
        "optimizer_state": optimizer_state,
        "lr_schedulers": first["schedulers"],
        "progress": saved,
    }


def write_checkpoint(
    checkpoint: dict[str, Any], state: Mapping[str, Any], params: Mapping[str, Tensor], finished: bool
) -> None:
    """Put a consolidated ``state`` into Lightning's ``checkpoint`` dict."""
    for name in state["params"]:
        # after fit the module already holds the final parameters; mid-fit the servers hold the newest
        checkpoint["state_dict"][name] = params[name].detach().clone() if finished else state["params"][name]
    checkpoint["optimizer_states"] = [state["optimizer_state"]]
    checkpoint["lr_schedulers"] = state["lr_schedulers"]
    checkpoint[CHECKPOINT_KEY] = state["progress"]
