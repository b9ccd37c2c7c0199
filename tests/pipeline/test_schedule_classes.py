"""Which torch schedule each ``ds_pipeline`` schedule name builds: in the table, and in the objects a real run used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

import ds_lightning
from ds_lightning.pipeline.schedules import SCHEDULES, canonical_name, schedule_spec
from tests.strategies.test_pipeline import _fit, launch

# Written out here, apart from the table under test.
EXPECTED = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
# The stages ranks 0 and 1 run: one each; two in a loop (r, r + 2); or two in a V (r, 3 - r).
ONE, LOOP, V = [[0], [1]], [[0, 2], [1, 3]], [[0, 3], [1, 2]]
STAGES = {
    "GPipe": ONE,
    "1F1B": ONE,
    "Interleaved1F1B": LOOP,
    "LoopedBFS": LOOP,
    "InterleavedZeroBubble": LOOP,
    "ZBVZeroBubble": V,
    "DualPipeV": V,
}


def torch_class(name: str) -> type:
    return getattr(torch_schedules, EXPECTED[name])


def test_the_pinned_torch_offers_all_seven_schedules_and_each_is_its_own_class():
    assert list(SCHEDULES) == list(EXPECTED)
    assert len({spec.torch_class for spec in SCHEDULES.values()}) == len(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_name_maps_to_its_torch_class_in_any_case(name):
    for spelling in (name, name.lower(), name.upper()):
        assert schedule_spec(spelling).torch_class is torch_class(name), spelling
        assert canonical_name(spelling) == name
    strategy = ds_lightning.PipelineStrategy(schedule=name.lower())
    assert strategy.schedule == name
    assert strategy._spec.torch_class is torch_class(name)
    assert strategy.stages_per_rank == len(STAGES[name][0])


# --- what a real 2-process run built and ran ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("classes")
    # Two training steps, each followed by one validation batch: the training and the forward-only schedule of every
    # name, and a step after the first (which learns the output's shape).
    trainer = {"limit_val_batches": 1, "val_check_interval": 1, "num_sanity_val_steps": 0}
    runs = [
        _fit(root / f"{name}.pt", {"schedule": name, "n_microbatches": 4}, 2, trainer=trainer, probe=str(root / name))
        for name in EXPECTED
    ]
    launch(root, "classes", 2, runs)
    return root


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_schedule_name_runs_its_torch_class_on_every_rank(probes, name):
    cls = torch_class(name)
    expected = f"{cls.__module__}.{cls.__qualname__}"
    for rank in (0, 1):
        path = probes / f"{name}.rank{rank}.json"
        assert path.exists(), f"{path} was not written"
        record = json.loads(path.read_text())
        assert record["global_step"] == 2
        assert set(record["schedules"]) == {"train", "eval"}, f"rank {rank}: {record['schedules']}"
        for mode, built in record["schedules"].items():
            assert built["class"] == expected, f"{name} rank {rank} {mode}"
            assert built["stages"] == STAGES[name][rank], f"{name} rank {rank} {mode}"
        # The schedule ran: this rank's layers saw the training step's micro-batches and the validation batch.
        phases = {phase for phase, *_ in record["calls"]}
        assert phases == {"train", "val"}, f"rank {rank}: {phases}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_first_stage_posts_the_outputs_receive_in_its_backward(probes, name):
    """Rank 0 holds the first stage: where it does not hold the last too (all but the V schedules), it receives the
    output and posts that receive from its first backward of each step after the first (the first learns the
    output's shape after the schedule); the other ranks post before the schedule or receive nothing."""
    posted = [json.loads((probes / f"{name}.rank{r}.json").read_text())["posted_in_backward"] for r in (0, 1)]
    holds_last = STAGES[name] == V
    assert posted == [[] if holds_last else [1], []], f"{name}: steps posted from a backward, per rank: {posted}"
