"""The schedule table's micro-batch rules and the forward-only variant of the V-shaped schedules, without processes.

torch's schedule constructors read only counts from their stages (stages per process, processes, stage indices), so
stand-in stages let torch itself say which micro-batch counts it refuses and which actions each rank runs. The
forward-only pipeline then runs for real on two stages in this process (a one-process gloo group).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from ds_lightning.pipeline.schedules import SCHEDULES, check_microbatches, make_forward_only

_Kind = torch_schedules._ComputationType
V_SHAPED = ["ZBVZeroBubble", "DualPipeV"]


def stand_in_stages(name: str, pipeline_size: int, rank: int = 0) -> list[Any]:
    """What a torch schedule reads from the stages of ``rank``, for the layout ds_pipeline uses for ``name``."""
    spec = SCHEDULES[name]
    n = pipeline_size * (2 if spec.multi_stage else 1)
    indices = [rank, 2 * pipeline_size - 1 - rank] if spec.style == "v" else list(range(rank, n, pipeline_size))
    return [
        SimpleNamespace(
            group_size=pipeline_size,
            group_rank=rank,
            num_stages=n,
            stage_index=i,
            is_first=i == 0,
            is_last=i == n - 1,
            submod=nn.Identity(),
        )
        for i in indices
    ]


def torch_schedule(name: str, pipeline_size: int, n_microbatches: int) -> Any:
    spec = SCHEDULES[name]
    stages = stand_in_stages(name, pipeline_size)
    return spec.torch_class(stages if spec.multi_stage else stages[0], n_microbatches=n_microbatches, loss_fn=None)


# --- check_microbatches ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "n_microbatches", "stages", "pipeline_size", "message"),
    [
        (
            "1F1B",
            3,
            4,
            4,
            r"schedule='1F1B' needs at least as many micro-batches as stages, but n_microbatches=3 < 4 stages\. "
            r"Set n_microbatches>=4, or use schedule='GPipe'\.",
        ),
        ("1f1b", 1, 2, 2, r"schedule='1F1B' .* n_microbatches=1 < 2 stages\. Set n_microbatches>=2"),
        ("ZBVZeroBubble", 3, 4, 2, r"schedule='ZBVZeroBubble' .* n_microbatches=3 < 4 stages"),
        ("DualPipeV", 7, 8, 4, r"schedule='DualPipeV' .* n_microbatches=7 < 8 stages\. Set n_microbatches>=8"),
        # Interleaved schedules run rounds of n_microbatches // pipeline size micro-batches each.
        ("Interleaved1F1B", 5, 4, 2, r"n_microbatches // pipeline size \(2\); n_microbatches=5 is not"),
        ("Interleaved1F1B", 9, 8, 4, r"n_microbatches=9 is not\. Use a multiple of 4"),
        (
            "InterleavedZeroBubble",
            5,
            4,
            2,
            r"schedule='InterleavedZeroBubble' .* n_microbatches // pipeline size \(2\); n_microbatches=5 is not",
        ),
    ],
)
def test_counts_the_schedule_cannot_run_are_refused_naming_the_value(
    name, n_microbatches, stages, pipeline_size, message
):
    with pytest.raises(ValueError, match=message):
        check_microbatches(name, n_microbatches, stages, pipeline_size)


@pytest.mark.parametrize(
    ("name", "n_microbatches", "stages", "pipeline_size"),
    [
        ("GPipe", 1, 8, 8),  # GPipe runs any count, fewer micro-batches than stages included
        ("1F1B", 4, 4, 4),  # as many micro-batches as stages is enough
        ("LoopedBFS", 1, 4, 2),
        ("Interleaved1F1B", 3, 8, 4),  # one round of 3: fewer micro-batches than processes is fine
        ("Interleaved1F1B", 10, 8, 4),  # two rounds of 5 (torch's own example)
        ("InterleavedZeroBubble", 6, 4, 2),
        ("ZBVZeroBubble", 4, 4, 2),
        ("DualPipeV", 8, 8, 4),
    ],
)
def test_counts_the_schedule_runs_are_accepted(name, n_microbatches, stages, pipeline_size):
    check_microbatches(name, n_microbatches, stages, pipeline_size)
    # torch agrees: its constructor accepts the same counts.
    torch_schedule(name, pipeline_size, n_microbatches)


def test_an_unknown_schedule_is_named_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"schedule='Zigzag' is not a torch pipeline schedule; choose one of \["):
        check_microbatches("Zigzag", 4, 2, 2)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_count_torch_refuses_is_refused_before_processes_start(name):
    # check_microbatches runs in set_world_ranks, before any process starts; torch refuses only once every
    # process has started and built its stages. Whatever torch refuses must be refused up front.
    spec = SCHEDULES[name]
    missed = []
    for pipeline_size in (1, 2, 3, 4):
        stages = pipeline_size * (2 if spec.multi_stage else 1)
        for n_microbatches in range(1, 13):
            try:
                torch_schedule(name, pipeline_size, n_microbatches)
            except ValueError:
                try:
                    check_microbatches(name, n_microbatches, stages, pipeline_size)
                except ValueError:
                    continue
                missed.append((pipeline_size, n_microbatches))
    assert not missed, f"{name}: torch refuses (pipeline size, n_microbatches) {missed}, check_microbatches accepts"


# --- make_forward_only: the action table ----------------------------------------------------------------------------


def _forward_only_order(name: str, pipeline_size: int, n_microbatches: int) -> dict[int, list[Any]]:
    schedule = torch_schedule(name, pipeline_size, n_microbatches)
    make_forward_only(schedule)
    return schedule.pipeline_order_with_comms


def _run_to_completion(order: dict[int, list[Any]], stage_rank: dict[int, int]) -> list[tuple[int, int]]:
    """Execute the per-rank action lists in lockstep, each rank blocking on a receive until its send was posted.

    Returns the forwards in execution order; fails if a forward runs without its input or the ranks deadlock.
    """
    done: set[tuple[str, int, int]] = set()
    cursor = dict.fromkeys(order, 0)
    executed = []
    while any(cursor[r] < len(order[r]) for r in order):
        progressed = False
        for rank, actions in order.items():
            while cursor[rank] < len(actions):
                action = actions[cursor[rank]]
                kind, stage, mb = action.computation_type, action.stage_index, action.microbatch_index
                if kind == _Kind.RECV_F and ("SEND_F", stage - 1, mb) not in done:
                    break  # the sender has not posted it yet
                if kind == _Kind.FORWARD and stage > 0:
                    local = stage_rank[stage - 1] == rank
                    needed = ("F", stage - 1, mb) if local else ("RECV_F", stage, mb)
                    assert needed in done, f"rank {rank} runs {action} before {needed}"
                if kind == _Kind.SEND_F:
                    assert ("F", stage, mb) in done, f"rank {rank} sends {action} before computing it"
                done.add((kind.value, stage, mb))
                if kind == _Kind.FORWARD:
                    executed.append((stage, mb))
                cursor[rank] += 1
                progressed = True
        assert progressed, f"deadlock: every rank waits; positions {cursor}"
    return executed


@pytest.mark.parametrize("name", V_SHAPED)
@pytest.mark.parametrize(("pipeline_size", "n_microbatches"), [(2, 4), (2, 6), (4, 8)])
def test_forward_only_table_runs_every_forward_once_and_no_backward(name, pipeline_size, n_microbatches):
    order = _forward_only_order(name, pipeline_size, n_microbatches)
    kinds = {action.computation_type for actions in order.values() for action in actions}
    assert kinds <= {_Kind.FORWARD, _Kind.SEND_F, _Kind.RECV_F}, f"non-forward actions left: {kinds}"
    n_stages = 2 * pipeline_size
    stage_rank = {s: s if s < pipeline_size else n_stages - 1 - s for s in range(n_stages)}  # the V
    for rank, actions in order.items():
        forwards = [(a.stage_index, a.microbatch_index) for a in actions if a.computation_type == _Kind.FORWARD]
        mine = sorted(s for s, r in stage_rank.items() if r == rank)
        assert sorted(forwards) == [(s, mb) for s in mine for mb in range(n_microbatches)], f"rank {rank}"
        for stage in mine:  # micro-batches enter each stage in order
            assert [mb for s, mb in forwards if s == stage] == list(range(n_microbatches))
    executed = _run_to_completion(order, stage_rank)
    assert sorted(executed) == [(s, mb) for s in range(n_stages) for mb in range(n_microbatches)]


# --- make_forward_only: a real run ----------------------------------------------------------------------------------


class _CountingStage(PipelineStage):
    """A PipelineStage that counts the backward passes it is asked to run."""

    backwards = 0

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        type(self).backwards += 1
        return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        type(self).backwards += 1
        return super().backward_weight_one_chunk(*args, **kwargs)


@pytest.mark.parametrize("name", V_SHAPED)
def test_forward_only_schedule_gives_the_model_output_without_backward(name, one_rank_group):
    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(6, 5), nn.Tanh()), nn.Linear(5, 3)]
    x = torch.randn(8, 6)
    with torch.no_grad():
        expected = parts[1](parts[0](x))
    _CountingStage.backwards = 0
    # One process runs both stages of the V.
    stages = [_CountingStage(part, i, 2, torch.device("cpu")) for i, part in enumerate(parts)]
    schedule = SCHEDULES[name].torch_class(stages, n_microbatches=4, loss_fn=None, scale_grads=False)
    make_forward_only(schedule)
    with torch.no_grad():
        torch.testing.assert_close(schedule.eval(x), expected)
        # The first run also infers the stages' shapes with a forward of its own; count the second.
        forwards = [0, 0]
        for i, part in enumerate(parts):
            part.register_forward_pre_hook(lambda module, args, i=i: forwards.__setitem__(i, forwards[i] + 1))
        torch.testing.assert_close(schedule.eval(2 * x), parts[1](parts[0](2 * x)))
    assert _CountingStage.backwards == 0
    assert forwards == [4 + 1, 4 + 1]  # one forward per micro-batch, plus the reference call
