"""The data order depends on the seed and the epoch only, and a cursor starts it at any sample (no processes)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ds_lightning.backup.position import draw_as_the_next_epoch_starts, random_states, set_random_states
from ds_lightning.data.resumable import DataCursor
from ds_lightning.data.share_plan import SharePlan
from ds_lightning.data.share_sampler import ShareBatchSampler


def _order(world: int, per_rank: int, epoch: int = 3) -> list[list[int]]:
    """Every micro-step's samples over all ranks, in rank order."""
    samplers = []
    for rank in range(world):
        sampler = ShareBatchSampler(100, SharePlan(per_rank * world, world, 0.0, 1.0, 0.0), rank, True, 5, lambda: 0)
        sampler.set_epoch(epoch)
        samplers.append(sampler)
    return [[i for part in parts for i in part] for parts in zip(*(list(s) for s in samplers), strict=True)]


def test_the_order_is_the_same_on_any_number_of_ranks() -> None:
    one = [i for step in _order(1, 16) for i in step]
    two = [i for step in _order(2, 8) for i in step]
    four = [i for step in _order(4, 4) for i in step]
    assert one == two == four
    assert sorted(one) == list(range(100))
    assert one != [i for step in _order(1, 16, epoch=4) for i in step]  # another epoch, another order


@pytest.mark.parametrize(("world", "skip"), [(1, 32), (2, 32), (2, 48), (4, 80)])
def test_a_cursor_resumes_at_the_sample_after_the_last_one_trained(world: int, skip: int) -> None:
    full = [i for step in _order(1, 16) for i in step]
    rest = []
    for rank in range(world):
        cursor = DataCursor()
        cursor.resume_at(3, skip)
        sampler = ShareBatchSampler(100, SharePlan(8 * world, world, 0.0, 1.0, 0.0), rank, True, 5, lambda: 0)
        sampler.cursor = cursor
        sampler.set_epoch(0)  # the epoch comes from the cursor, as with workers Lightning sets it late
        rest.append(list(sampler))
        assert len(list(sampler)) == len(sampler)  # the cursor is used once: the next iteration is a whole epoch
    resumed = [i for step in zip(*rest, strict=True) for part in step for i in part]
    assert resumed == full[skip:]


def test_random_states_round_trip_through_a_weights_only_checkpoint(tmp_path) -> None:
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    saved = random_states()
    path = tmp_path / "states.pt"
    torch.save(saved, path)
    expected = (torch.rand(3), random.random(), np.random.rand())
    set_random_states(torch.load(path, weights_only=True))
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == (expected[0].tolist(), *expected[1:])


def test_an_epoch_end_restore_draws_what_starting_the_next_epoch_draws() -> None:
    """The uninterrupted run starts the next epoch's iterators after the backed-up states; a restored run already has
    them. The helper's draw leaves torch's generator where starting them does (control: without it, elsewhere)."""
    loaders = {"a": DataLoader(list(range(8)), batch_size=2), "b": [DataLoader(list(range(4)), batch_size=2)]}
    saved = torch.get_rng_state()
    for loader in (loaders["a"], loaders["b"][0]):
        iter(loader)
    uninterrupted = torch.get_rng_state()
    torch.set_rng_state(saved)
    draw_as_the_next_epoch_starts(loaders)
    assert torch.equal(torch.get_rng_state(), uninterrupted)
    assert not torch.equal(saved, uninterrupted)
    seeded = DataLoader(list(range(4)), generator=torch.Generator().manual_seed(0))  # draws from its own generator
    draw_as_the_next_epoch_starts(seeded)
    assert torch.equal(torch.get_rng_state(), uninterrupted)
