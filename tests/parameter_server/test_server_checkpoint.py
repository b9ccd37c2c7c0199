"""A server's part of a sharded checkpoint, without processes: the row blocks, the refusal, and the planner.

The servers' collective save (every server its rows, read back whole) is tested with real processes in
tests/checkpoint/test_sharded_checkpoints.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from ds_lightning.checkpoint.layout import SavedShards, read_part
from ds_lightning.parameter_server.optimizer_shard import ShardOptimizer
from ds_lightning.parameter_server.server_checkpoint import RowBlock, RowBlockPlanner, _place, server_part
from ds_lightning.parameter_server.sharding import ShardSlice, plan_shards


def _shards(num_servers: int) -> tuple[nn.Module, list[ShardOptimizer]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    params = dict(model.named_parameters())
    plan = plan_shards(params, num_servers, min_shard_bytes=1)
    template = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    shards = []
    for server in range(num_servers):
        shard = ShardOptimizer(template, params, plan, server)
        shard.flat.copy_(plan.flatten(params, server))
        shard.apply(torch.ones_like(shard.flat))  # creates the momentum
        shards.append(shard)
    return model, shards


def test_each_server_writes_row_blocks_of_the_whole_tensors() -> None:
    """With 2 servers the blocks of every parameter and of its momentum tile the whole tensor, each block at its rows.
    Control: one server holds every tensor whole, so its blocks each start at row 0 and cover every row."""
    model, shards = _shards(2)
    covered: dict[tuple[str, ...], int] = {}
    for shard in shards:
        state, blocks = server_part(shard, shard.plan)
        assert state == {}  # no scalar state under SGD, every tensor in rows
        for block in blocks:
            assert block.tensor.is_contiguous() and block.tensor.shape[1:] == block.size[1:]
            covered[block.path] = covered.get(block.path, 0) + block.tensor.shape[0]
    names = [name for name, _ in model.named_parameters()]
    expected = {("model", n): p.shape[0] for n, p in model.named_parameters()}
    expected |= {("optimizer_0", "state", n, "momentum_buffer"): p.shape[0] for n, p in model.named_parameters()}
    assert covered == expected
    assert any(block.first_row > 0 for shard in shards for block in server_part(shard, shard.plan)[1])
    _, (alone,) = _shards(1)
    _, blocks = server_part(alone, alone.plan)
    assert {block.first_row for block in blocks} == {0} and len(blocks) == 2 * len(names)


def test_a_state_tensor_that_is_not_per_row_is_refused_with_the_fix() -> None:
    piece = ShardSlice("w", server=1, rows=(2, 4), shape=(2, 3), offset=0, numel=6)
    with pytest.raises(ValueError, match=r"'odd' of w has 5 elements.*rows \(2, 4\).*state_dict_type='full'"):
        _place(("optimizer_0", "state", "w", "odd"), torch.zeros(5), piece, 4, {}, [])


def test_the_planner_writes_blocks_that_read_back_whole(tmp_path: Path) -> None:
    """Two row blocks of one tensor and a plain entry, saved by one process, read back as the whole tensor under its
    name (DCP joins the chunks). Control: blocks whose rows overlap fail DCP's check of the chunks."""
    whole = torch.arange(12.0).view(4, 3)
    blocks = [RowBlock(("model", "net.w"), whole[:1].clone(), whole.shape, 0)]
    blocks.append(RowBlock(("model", "net.w"), whole[1:].clone(), whole.shape, 1))
    state = {"model": {"net.b": torch.ones(2)}}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "ok"), planner=RowBlockPlanner(blocks), no_dist=True)
    (tmp_path / "ok" / "meta.pt").touch()
    model = read_part(SavedShards(tmp_path / "ok", "model"))
    torch.testing.assert_close(model["net.w"], whole)
    torch.testing.assert_close(model["net.b"], torch.ones(2))
    overlapping = [blocks[0], RowBlock(("model", "net.w"), whole[:2].clone(), whole.shape, 0)]
    with pytest.raises(CheckpointException, match="overlapping chunks"):
        dcp.save(
            state, storage_writer=FileSystemWriter(tmp_path / "bad"), planner=RowBlockPlanner(overlapping), no_dist=True
        )
