"""The parameter-server checkpoint layout: the on-disk entry, the shard messages, and a consolidation round trip."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ds_lightning.parameter_server.checkpoint import (
    CHECKPOINT_KEY,
    ConsolidatedRun,
    ResumePoint,
    ServerProgress,
    ServingProgress,
    ShardState,
    consolidate,
    starting_shards,
)
from tests.parameter_server.test_optimizer_shard import _adam_two_groups, _assert_states_equal, _Pair, _params

# The entry as checkpoints written before the layout was typed hold it (keys and value types).
SAVED_ENTRY = {
    "updates": 8,
    "version": 8,
    "epoch": 1,
    "clocks": [4, 4],
    "worker_progress": [[4, 1], [4, 1]],
    "lost": [],
    "num_servers": 2,
    "num_workers": 2,
    "max_staleness": None,
}


def test_an_existing_entry_loads_and_is_written_back_unchanged():
    progress = ServerProgress.from_dict(SAVED_ENTRY)
    assert progress.updates == 8 and progress.clocks == [4, 4] and progress.max_staleness is None
    assert progress.to_dict() == SAVED_ENTRY


def test_an_entry_with_fields_missing_or_unknown_keeps_defaults_and_ignores_the_rest():
    progress = ServerProgress.from_dict({"updates": 3, "written_by_a_later_version": True})
    assert progress == ServerProgress(updates=3)


def test_a_shard_message_carries_the_tensors_in_place_and_the_rest_in_the_header():
    flat, state = torch.arange(6.0), [torch.ones(2), torch.tensor(3.0)]
    progress = ServingProgress(updates=5, version=7, epoch=1, clocks=[3, 2], worker_progress=[[3, 1], [2, 1]], lost=[1])
    shard = ShardState(flat, [[0, "exp_avg"], [0, "step"]], state, [{"lr": 0.1}], [{"last_epoch": 2}], progress)
    header, tensors = shard.to_message()
    assert tensors[0] is flat and tensors[1:] == state
    assert header["n_state"] == 2 and header["state_entries"] == [[0, "exp_avg"], [0, "step"]]
    assert "flat" not in header and "state" not in header
    back = ShardState.from_message({"op": "state", **header, "stop": False}, tensors)
    assert back == shard


def test_resume_point_reads_a_parameter_server_checkpoint_and_a_plain_one():
    optimizer_state = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    ours = {"optimizer_states": [optimizer_state], "lr_schedulers": [{"x": 1}], CHECKPOINT_KEY: SAVED_ENTRY}
    resume = ResumePoint.from_checkpoint({**ours, "global_step": 99})
    assert resume.optimizer_state is optimizer_state and resume.lr_schedulers == [{"x": 1}]
    assert resume.updates == 8  # the servers' count, not the chief's steps
    plain = ResumePoint.from_checkpoint({"optimizer_states": [optimizer_state], "global_step": 12})
    assert plain.progress is None and plain.updates == 12
    assert ResumePoint.from_checkpoint({}) == ResumePoint()


def test_write_into_puts_each_part_under_its_lightning_key():
    params = {"w": torch.zeros(2)}
    run = ConsolidatedRun(params, {"state": {}, "param_groups": []}, [{"s": 1}], ServerProgress.from_dict(SAVED_ENTRY))
    checkpoint: dict = {"state_dict": {"w": torch.full((2,), 5.0), "buffer": torch.ones(1)}}
    run.write_into(checkpoint)
    assert torch.equal(checkpoint["state_dict"]["w"], torch.zeros(2)) and "buffer" in checkpoint["state_dict"]
    assert checkpoint["optimizer_states"] == [run.optimizer_state] and checkpoint["lr_schedulers"] == [{"s": 1}]
    assert checkpoint[CHECKPOINT_KEY] == SAVED_ENTRY
    run.write_into(checkpoint, final_params={"w": torch.full((2,), 7.0)})  # after fit: the module's own values
    assert torch.equal(checkpoint["state_dict"]["w"], torch.full((2,), 7.0))


def test_starting_shards_then_the_servers_answers_consolidate_to_the_saved_run():
    pair = _Pair(_adam_two_groups, 3)
    pair.step(3)
    saved = pair.reference.state_dict()
    resume = ResumePoint(optimizer_state=copy.deepcopy(saved), lr_schedulers=[], global_step=3)
    values = {name: p.detach().clone() for name, p in _params(pair.model).items()}
    starts = starting_shards(pair.plan, values, resume, pair.index_of, epoch=0)

    # Each server starts from its message and answers with its own, as init and state do.
    pair.shards = pair.build_shards({name: torch.zeros_like(v) for name, v in values.items()})
    answers = []
    for server, (shard, start) in enumerate(zip(pair.shards, starts, strict=True)):
        received = ShardState.from_message(*start.to_message())
        shard.flat.copy_(received.flat)
        shard.import_state(received.entries, received.state)
        entries, state = shard.export_state()
        answers.append(ShardState(shard.flat, entries, state, received.param_groups, [], received.progress))
        assert received.progress.updates == 3 and server < pair.plan.num_servers

    run = {"num_servers": 3, "num_workers": 2, "max_staleness": 0}
    zeros = {name: torch.zeros_like(v) for name, v in values.items()}
    result = consolidate(answers, pair.plan, zeros, pair.reference, pair.index_of, run)
    for name, value in values.items():
        torch.testing.assert_close(result.params[name], value)  # from the servers, not the zeros passed in
    _assert_states_equal(result.optimizer_state["state"], saved["state"])
    as_json = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in saved["param_groups"]]
    assert result.optimizer_state["param_groups"] == as_json  # settings travel as JSON: Adam's betas as a list
    assert result.progress.updates == 3 and result.progress.num_servers == 3

    # Control: one server's state zeroed (state dropped on the way) shows in the consolidated state.
    answers[0] = dataclasses.replace(answers[0], state=[torch.zeros_like(t) for t in answers[0].state])
    dropped = consolidate(answers, pair.plan, zeros, pair.reference, pair.index_of, run)
    with pytest.raises(AssertionError):
        _assert_states_equal(dropped.optimizer_state["state"], saved["state"])
