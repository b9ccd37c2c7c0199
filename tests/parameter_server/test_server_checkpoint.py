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
    planner = RowBlockPlanner(lambda: (state, blocks))
    dcp.save({}, storage_writer=FileSystemWriter(tmp_path / "ok"), planner=planner, no_dist=True)
    (tmp_path / "ok" / "meta.pt").touch()
    model = read_part(SavedShards(tmp_path / "ok", "model"))
    torch.testing.assert_close(model["net.w"], whole)
    torch.testing.assert_close(model["net.b"], torch.ones(2))
    overlapping = [blocks[0], RowBlock(("model", "net.w"), whole[:2].clone(), whole.shape, 0)]
    with pytest.raises(CheckpointException, match="overlapping chunks"):
        planner = RowBlockPlanner(lambda: (state, overlapping))
        dcp.save({}, storage_writer=FileSystemWriter(tmp_path / "bad"), planner=planner, no_dist=True)


@pytest.mark.multiprocess
def test_a_server_that_cannot_build_its_part_fails_every_servers_save_at_once(tmp_path: Path) -> None:
    """Server 0's part fails while it is built in DCP's planning step: server 1's save fails with server 0's error,
    not after the group's timeout. Control: built before the save starts, server 1 waits for server 0 until the
    timeout and its error does not say why."""
    from tests.helpers.runner import run_ranks
    from tests.helpers.server_part_workers import PLANTED, TIMEOUT_S

    shared = run_ranks("tests.helpers.server_part_workers", ["in_plan", str(tmp_path / "a")], 2, timeout=120)
    shared.assert_every_rank_exits(0)
    server1 = shared.output.split("--- rank 1")[1]
    assert PLANTED in server1 and "CheckpointException" in server1, shared.output[-3000:]
    assert float(server1.split("failed after ")[1].split(" s")[0]) < TIMEOUT_S

    control = run_ranks("tests.helpers.server_part_workers", ["before", str(tmp_path / "b")], 2, timeout=120)
    control.assert_every_rank_exits(0)
    server1 = control.output.split("--- rank 1")[1]
    assert "failed after" in server1 and PLANTED not in server1, control.output[-3000:]
    assert float(server1.split("failed after ")[1].split(" s")[0]) >= TIMEOUT_S - 1
