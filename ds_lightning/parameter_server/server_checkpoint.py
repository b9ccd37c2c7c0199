"""A server's part of a sharded checkpoint: each server writes its own rows of the parameters and optimizer state.

With ``state_dict_type="sharded"`` the chief asks every server to write (op ``save``) and the servers run one
``torch.distributed.checkpoint`` save among themselves, on a gloo group of the servers alone made at set-up (server 0
is DCP's coordinator); the chief adds ``meta.pt`` once every server answered. Nothing of the parameters or of the
optimizer state passes through the chief, whose part (buffers and frozen parameters, which no server holds, and the
names of each param group's parameters) goes to server 0 in the request.

A server holds row blocks of parameters (:mod:`~ds_lightning.parameter_server.sharding`). Each block is written as a
chunk of the whole tensor (a ``SHARD`` write item of DCP's planner, as a ShardedTensor's shard is), so the folder
reads back as whole tensors keyed by parameter name: at another number of servers, under another strategy, or
consolidated into one file by Lightning's ``consolidate_checkpoint``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from typing_extensions import override

from ds_lightning.checkpoint.layout import MODEL_KEY, optimizer_key, set_nested
from ds_lightning.parameter_server.checkpoint import hyperparameters
from ds_lightning.parameter_server.optimizer_shard import ShardOptimizer
from ds_lightning.parameter_server.sharding import ParameterShardPlan, ShardSlice

__all__ = ["RowBlock", "RowBlockPlanner", "write_server_part"]


@dataclass(frozen=True)
class RowBlock:
    """Rows ``[first_row, first_row + len(tensor))`` of a whole tensor of ``size``, at ``path`` in the state dict.

    Attributes:
        path: the keys leading to the whole tensor (``("model", "net.0.weight")``).
        tensor: this server's rows, contiguous.
        size: the whole tensor's shape.
        first_row: where the rows start along dim 0.

    """

    path: tuple[str, ...]
    tensor: Tensor
    size: torch.Size
    first_row: int

    @property
    def flat_key(self) -> str:
        """The key DCP's flattening gives the path (its parts joined by dots)."""
        return ".".join(self.path)

    def write_item(self) -> WriteItem:
        """The chunk as DCP's planner describes a shard of a larger tensor."""
        offsets = torch.Size([self.first_row, *([0] * (len(self.size) - 1))])
        return WriteItem(
            index=MetadataIndex(self.flat_key, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=self.tensor.size()),
                properties=TensorProperties.create_from_tensor(self.tensor),
                size=self.size,
            ),
        )


class RowBlockPlanner(DefaultSavePlanner):
    """DCP's default save planner, plus this process's :class:`RowBlock` chunks (kept out of the state dict).

    Args:
        part: builds this process's ``(plain entries, row blocks)``. It is called in DCP's planning step, whose errors
            DCP hands to every process of the save: a server that cannot build its part fails every server's save at
            once, instead of leaving the others waiting for it until the group's timeout.

    """

    def __init__(self, part: Callable[[], tuple[dict[str, Any], list[RowBlock]]]) -> None:
        super().__init__()
        self._part = part
        self.blocks: list[RowBlock] = []
        self._by_index: dict[tuple[str, int], RowBlock] = {}

    @override
    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        entries, self.blocks = self._part()
        # Keyed by (key, first row): a server may hold several row blocks of one tensor.
        self._by_index = {(block.flat_key, block.first_row): block for block in self.blocks}
        super().set_up_planner({**state_dict, **entries}, storage_meta, is_coordinator)

    @override
    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [*plan.items, *(block.write_item() for block in self.blocks)]
        # The paths, as the default planner records them for flattened keys: readers rebuild the nesting from them.
        paths = {**(plan.planner_data or {}), **{block.flat_key: block.path for block in self.blocks}}
        self.plan = dataclasses.replace(plan, items=items, planner_data=paths)
        return self.plan

    @override
    def resolve_data(self, write_item: WriteItem) -> Any:
        offset = write_item.index.offset
        block = self._by_index.get((write_item.index.fqn, offset[0] if offset else -1))
        return block.tensor if block is not None else super().resolve_data(write_item)


def _whole_rows(plan: ParameterShardPlan) -> dict[str, int]:
    rows: dict[str, int] = {}
    for piece in plan.slices:
        rows[piece.name] = max(rows.get(piece.name, 0), piece.rows[1])
    return rows


def _place(
    path: tuple[str, ...],
    value: Tensor,
    piece: ShardSlice,
    whole_rows: int,
    state: dict[str, Any],
    blocks: list[RowBlock],
) -> None:
    """Put one of the piece's tensors into the part: as rows of the whole tensor, or whole where it is not split."""
    whole = piece.rows == (0, whole_rows)
    if value.dim() == 0 or not piece.shape or (whole and value.numel() != piece.numel):
        # A per-parameter scalar (Adam's step, the same on every piece; DCP writes one copy) or an unsplit tensor.
        set_nested(state, path, value)
    elif value.numel() == piece.numel:
        size = torch.Size((whole_rows, *piece.shape[1:]))
        blocks.append(RowBlock(path, value.reshape(piece.shape).contiguous(), size, piece.rows[0]))
    else:
        raise ValueError(
            f"The optimizer's state {path[-1]!r} of {piece.name} has {value.numel()} elements where the server holds"
            f" rows {piece.rows} ({piece.numel} elements) of it, so it cannot be written as those rows; use"
            " state_dict_type='full', or min_shard_bytes large enough that the parameter is not split."
        )


def server_part(shard: ShardOptimizer, plan: ParameterShardPlan) -> tuple[dict[str, Any], list[RowBlock]]:
    """This server's parameters and optimizer state in the sharded layout: ``(plain entries, row blocks)``."""
    rows = _whole_rows(plan)
    state: dict[str, Any] = {}
    blocks: list[RowBlock] = []
    for piece in shard.slices:
        value = shard.flat[piece.offset : piece.offset + piece.numel].view(piece.shape)
        _place((MODEL_KEY, piece.name), value, piece, rows[piece.name], state, blocks)
    entries, tensors = shard.export_state()
    for (index, key), value in zip(entries, tensors, strict=True):
        piece = shard.slices[int(index)]
        _place((optimizer_key(0), "state", piece.name, str(key)), value, piece, rows[piece.name], state, blocks)
    return state, blocks


def write_server_part(
    shard: ShardOptimizer,
    plan: ParameterShardPlan,
    folder: Path,
    group_names: Sequence[Sequence[str]] | None,
    chief_model: Mapping[str, Tensor],
) -> None:
    """Write this server's part into ``folder``; collective over the servers' group (every server calls it).

    Args:
        shard: this server's parameters and optimizer.
        plan: the shard plan.
        folder: the checkpoint folder (made by the chief).
        group_names: on server 0, each param group's parameter names (from the chief), written with this server's
            current hyperparameters as the optimizer's ``param_groups``; ``None`` on the others.
        chief_model: on server 0, the module state no server holds (buffers, frozen parameters), sent by the chief.

    """

    def part() -> tuple[dict[str, Any], list[RowBlock]]:
        state, blocks = server_part(shard, plan)
        if group_names is not None:
            groups = hyperparameters(shard.template.param_groups)
            param_groups = [{**hyper, "params": list(names)} for hyper, names in zip(groups, group_names, strict=True)]
            set_nested(state, (optimizer_key(0), "param_groups"), param_groups)
        for name, value in chief_model.items():
            set_nested(state, (MODEL_KEY, name), value)
        return state, blocks

    alone = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
    dcp.save({}, storage_writer=FileSystemWriter(folder), planner=RowBlockPlanner(part), no_dist=alone)
