"""Checkpoints: the servers' shards consolidated into one Lightning checkpoint, and split again on resume.

A checkpoint holds the parameters and the optimizer state as one process would have them (the single-process layout
of :mod:`ds_lightning.sharding.optimizer_layout`), so a plain Trainer, or a run with another number of servers,
resumes from it. The layout is typed here, once:

- :class:`ShardState`: one server's shard as it travels (the ``init`` and ``state`` messages): parameters, its pieces
  of the optimizer state, hyperparameters, scheduler state and the serving progress;
- :class:`ServerProgress`: the checkpoint's ``ds_parameter_server`` entry (a :class:`ServingProgress` and the run);
- :class:`ConsolidatedRun`: what a checkpoint holds of the run, written into Lightning's checkpoint dict;
- :class:`ResumePoint`: what the chief reads back from one to start the servers.

Optimizer state moves between the servers' row-block pieces and the single-process layout only here
(:func:`consolidate_state`, :func:`split_full_state`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Self

import torch
from torch import Tensor
from torch.optim import Optimizer

from ds_lightning.parameter_server.sharding import ParameterShardPlan

CHECKPOINT_KEY = "ds_parameter_server"
_NO_PARAMS = "params"


def jsonable(value: Any) -> Any:
    """State as JSON (it travels in message headers): tensors become lists, functions (LambdaLR's) become None."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Tensor):
        return value.tolist()
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return None


def hyperparameters(param_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each param group's settings without its parameters, as JSON."""
    return [jsonable({k: v for k, v in group.items() if k != _NO_PARAMS}) for group in param_groups]


@dataclass
class ServingProgress:
    """Where serving stands: what a server reports with its shard, and the start of a checkpoint's entry.

    Attributes:
        updates: updates applied (the run's, counted from its first start).
        version: the parameters' version (updates, plus those of the checkpoint the run resumed from).
        epoch: epochs the servers stepped their epoch-wise schedulers for.
        clocks: pushes of each worker in this run.
        worker_progress: ``[global_step, epoch]`` each worker last reported.
        lost: the workers the servers lost.

    """

    updates: int = 0
    version: int = 0
    epoch: int = 0
    clocks: list[int] = field(default_factory=list)
    worker_progress: list[list[int]] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The fields as they are saved (and sent): plain JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> Self:
        """Read saved fields; a field ``saved`` lacks keeps its default, a key this class does not know is ignored."""
        return cls(**{name: saved[name] for name in cls.__dataclass_fields__ if name in saved})


@dataclass
class ServerProgress(ServingProgress):
    """The checkpoint's ``ds_parameter_server`` entry: where serving stood, and the run that wrote it.

    Attributes:
        num_servers: servers of the run that wrote it.
        num_workers: workers of the run that wrote it.
        max_staleness: the run's staleness bound.

    """

    num_servers: int = 1
    num_workers: int = 1
    max_staleness: int | None = None


@dataclass
class ShardState:
    """One server's shard as it travels in an ``init`` or ``state`` message.

    The header carries every field but the tensors; the tensors are ``[flat, *state]``.

    Attributes:
        flat: the server's parameters, flattened as its plan lays them out.
        entries: ``[piece index, key]`` of each tensor in ``state``.
        state: the optimizer state of the server's pieces.
        param_groups: each param group's hyperparameters (no ``params``).
        schedulers: each LR scheduler's ``state_dict()``, as JSON.
        progress: where the server's serving stands.

    """

    flat: Tensor
    entries: list[list[Any]] = field(default_factory=list)
    state: list[Tensor] = field(default_factory=list)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    progress: ServingProgress = field(default_factory=ServingProgress)

    def to_message(self) -> tuple[dict[str, Any], list[Tensor]]:
        """The message's header and tensors."""
        header = {"param_groups": self.param_groups, "schedulers": self.schedulers, **self.progress.to_dict()}
        header.update(state_entries=self.entries, n_state=len(self.state))
        return header, [self.flat, *self.state]

    @classmethod
    def from_message(cls, header: Mapping[str, Any], tensors: Sequence[Tensor]) -> ShardState:
        """Read a message written by :meth:`to_message` (a header may carry other fields too)."""
        n_state = int(header["n_state"])
        return cls(
            flat=tensors[0],
            entries=[list(entry) for entry in header["state_entries"]],
            state=list(tensors[1 : 1 + n_state]),
            param_groups=list(header.get("param_groups", [])),
            schedulers=list(header.get("schedulers", [])),
            progress=ServingProgress.from_dict(header),
        )


@dataclass
class ConsolidatedRun:
    """What a checkpoint holds of a parameter-server run, in the single-process layout.

    Attributes:
        params: each trainable parameter by name.
        optimizer_state: the single-process ``optimizer.state_dict()``.
        lr_schedulers: each LR scheduler's ``state_dict()``.
        progress: the ``ds_parameter_server`` entry.

    """

    params: dict[str, Tensor]
    optimizer_state: dict[str, Any]
    lr_schedulers: list[Any]
    progress: ServerProgress

    def write_into(self, checkpoint: dict[str, Any], final_params: Mapping[str, Tensor] | None = None) -> None:
        """Put the run into Lightning's ``checkpoint`` dict.

        Args:
            checkpoint: Lightning's checkpoint dict.
            final_params: after fit, the module's own parameters (already the final ones) in place of :attr:`params`.

        """
        for name, value in self.params.items():
            checkpoint["state_dict"][name] = final_params[name].detach().clone() if final_params is not None else value
        checkpoint["optimizer_states"] = [self.optimizer_state]
        checkpoint["lr_schedulers"] = self.lr_schedulers
        checkpoint[CHECKPOINT_KEY] = self.progress.to_dict()


@dataclass
class ResumePoint:
    """What the chief reads from a checkpoint to start the servers (all empty: a fresh start).

    Attributes:
        optimizer_state: the single-process optimizer state, or ``None``.
        lr_schedulers: each LR scheduler's ``state_dict()``.
        progress: the ``ds_parameter_server`` entry, or ``None`` (a checkpoint of another strategy).
        global_step: Lightning's step counter (the update count when ``progress`` is missing).

    """

    optimizer_state: dict[str, Any] | None = None
    lr_schedulers: list[Any] = field(default_factory=list)
    progress: ServerProgress | None = None
    global_step: int = 0

    @classmethod
    def from_checkpoint(cls, checkpoint: Mapping[str, Any]) -> ResumePoint:
        """Read any Lightning checkpoint: a parameter-server run's, or a plain one's."""
        states = checkpoint.get("optimizer_states") or []
        saved = checkpoint.get(CHECKPOINT_KEY)
        return cls(
            optimizer_state=states[0] if states else None,
            lr_schedulers=list(checkpoint.get("lr_schedulers", [])),
            progress=ServerProgress.from_dict(saved) if saved else None,
            global_step=int(checkpoint.get("global_step", 0)),
        )

    @property
    def updates(self) -> int:
        """The update count the servers start from."""
        return self.progress.updates if self.progress is not None else self.global_step


def starting_shards(
    plan: ParameterShardPlan,
    params: Mapping[str, Tensor],
    resume: ResumePoint,
    index: Mapping[str, int],
    epoch: int,
) -> list[ShardState]:
    """Each server's starting shard: its parameters, its piece of a resumed optimizer state, and the progress."""
    full = resume.optimizer_state
    groups = hyperparameters(full["param_groups"]) if full else []
    schedulers = jsonable(resume.lr_schedulers)
    shards = []
    for server in range(plan.num_servers):
        entries, state = split_full_state(plan, server, full, index) if full else ([], [])
        flat = plan.flatten(params, server).float().cpu()
        progress = ServingProgress(updates=resume.updates, epoch=epoch)
        shards.append(ShardState(flat, entries, state, groups, schedulers, progress))
    return shards


def consolidate(
    shards: Sequence[ShardState],
    plan: ParameterShardPlan,
    params: Mapping[str, Tensor],
    optimizer: Optimizer,
    index: Mapping[str, int],
    run: Mapping[str, Any],
) -> ConsolidatedRun:
    """The run in the single-process layout, from every server's shard.

    Args:
        shards: server 0's, 1's, ... shard (what ``state`` or ``done`` answers).
        plan: which server holds what.
        params: the worker's parameters (their shapes, and values for what no server holds).
        optimizer: the worker's optimizer, whose param groups the state dict takes.
        index: each parameter's number in the optimizer state
            (:func:`~ds_lightning.sharding.optimizer_layout.index_by_name`).
        run: the ``num_servers``, ``num_workers`` and ``max_staleness`` of the run, for :class:`ServerProgress`.

    """
    values = {n: p.detach().clone() for n, p in params.items()}
    for server, shard in enumerate(shards):
        plan.unflatten_into(shard.flat, server, values)
    first = shards[0]
    groups = optimizer.state_dict()["param_groups"]
    for group, hyper in zip(groups, first.param_groups, strict=True):
        group.update(hyper)
    shapes = {n: p.shape for n, p in params.items()}
    pieces = [(shard.entries, shard.state) for shard in shards]
    progress = ServerProgress(**first.progress.to_dict(), **run)
    return ConsolidatedRun(values, consolidate_state(plan, pieces, shapes, index, groups), first.schedulers, progress)


def consolidate_state(
    plan: ParameterShardPlan,
    shards: Sequence[tuple[Sequence[Sequence[Any]], Sequence[Tensor]]],
    shapes: Mapping[str, torch.Size],
    index_of: Mapping[str, int],
    param_groups: list[dict[str, Any]],
) -> dict[str, Any]:
    """Merge every server's exported optimizer state into one single-device ``optimizer.state_dict()``.

    Args:
        plan: the shard plan.
        shards: ``ShardOptimizer.export_state()`` of server 0, 1, ...
        shapes: full shape of each parameter by name.
        index_of: the parameter's number in the single-device state dict, by name.
        param_groups: the ``param_groups`` entry to write (hyperparameters and numbers).

    """
    pieces: dict[str, dict[str, list[tuple[int, Tensor]]]] = {}
    for server, (entries, tensors) in enumerate(shards):
        slices = plan.server_slices(server)
        for (index, key), value in zip(entries, tensors, strict=True):
            piece = slices[int(index)]
            pieces.setdefault(piece.name, {}).setdefault(str(key), []).append((piece.rows[0], value))
    state: dict[int, dict[str, Tensor]] = {}
    for name, keys in pieces.items():
        full: dict[str, Tensor] = {}
        for key, parts in keys.items():
            parts.sort(key=lambda part: part[0])
            first = parts[0][1]
            if first.dim() == 0 or (len(parts) == 1 and first.numel() != shapes[name].numel()):
                full[key] = first  # per-parameter scalar such as Adam's step; equal on every piece
            else:
                full[key] = torch.cat([part.reshape(-1) for _, part in parts]).view(shapes[name])
        state[index_of[name]] = full
    return {"state": state, "param_groups": param_groups}


def split_full_state(
    plan: ParameterShardPlan, server: int, full_state: Mapping[str, Any], index_of: Mapping[str, int]
) -> tuple[list[list[Any]], list[Tensor]]:
    """The part of a single-device optimizer state that belongs to ``server``, for ``ShardOptimizer.import_state``."""
    state = full_state.get("state", {})
    entries: list[list[Any]] = []
    tensors: list[Tensor] = []
    for index, piece in enumerate(plan.server_slices(server)):
        for key, value in sorted(state.get(index_of[piece.name], {}).items()):
            value = torch.as_tensor(value)
            is_rows = bool(piece.shape) and value.dim() == len(piece.shape) and value.shape[1:] == piece.shape[1:]
            if is_rows and value.shape[0] >= piece.rows[1]:
                value = value[piece.rows[0] : piece.rows[1]]
            tensors.append(value.detach().clone().contiguous())
            entries.append([index, key])
    return entries, tensors
