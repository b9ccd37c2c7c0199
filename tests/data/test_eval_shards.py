"""Unpadded evaluation shards, in one process: the same shards as DistributedSampler's, without its repeats."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from ds_lightning.data.eval_shards import (
    EvalShardError,
    UnpaddedShard,
    exact_mean_input,
    uneven_batch_counts,
    unpadded_eval_loader,
)


def sharded_loader(size: int, replicas: int, rank: int, shuffle: bool = False, batch_size: int = 4) -> DataLoader:
    data = TensorDataset(torch.arange(size))
    sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5)
    return DataLoader(data, sampler=sampler, batch_size=batch_size)


@pytest.mark.parametrize("size", [359, 360, 361, 3])
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_hold_every_sample_once_in_the_samplers_order(size: int, replicas: int, shuffle: bool) -> None:
    seen = []
    for rank in range(replicas):
        loader = sharded_loader(size, replicas, rank, shuffle)
        loader.sampler.set_epoch(2)
        padded = list(loader.sampler)
        unpadded = unpadded_eval_loader(loader, replicas, rank, "ds_test")
        unpadded.sampler.set_epoch(2)
        indices = [int(i) for (batch,) in unpadded for i in batch]
        assert indices == padded[: len(indices)]  # the same order, the repeats cut off the end
        assert len(unpadded) == -(-len(indices) // 4)
        seen += indices
    assert sorted(seen) == list(range(size))


def test_control_padded_sampler_repeats_and_the_loader_stays_untouched() -> None:
    loader = sharded_loader(359, 2, 1)
    assert len(list(loader.sampler)) == 180  # Lightning's DistributedSampler pads 179 to 180
    unpadded = unpadded_eval_loader(loader, 2, 1, "ds_test")
    assert isinstance(unpadded.sampler, UnpaddedShard) and len(unpadded.sampler) == 179
    assert isinstance(loader.sampler, DistributedSampler) and type(loader.batch_sampler) is BatchSampler


def test_even_split_and_other_layouts_pass_through() -> None:
    even = sharded_loader(360, 2, 0)
    assert unpadded_eval_loader(even, 2, 0, "ds_test") is even
    other = sharded_loader(359, 2, 0)
    assert unpadded_eval_loader(other, 4, 0, "ds_test") is other  # built for another layout: the user's choice


def test_uneven_batch_counts_with_caps() -> None:
    loader = unpadded_eval_loader(sharded_loader(361, 2, 0, batch_size=20), 2, 0, "ds_test")
    assert uneven_batch_counts(loader) == [10, 9]
    assert uneven_batch_counts(loader, cap=5) is None
    assert uneven_batch_counts(unpadded_eval_loader(sharded_loader(359, 2, 0, batch_size=20), 2, 0, "x")) is None


def test_a_rank_without_a_batch_is_refused_naming_the_fix() -> None:
    with pytest.raises(EvalShardError, match=r"2 sample\(s\).*3 data-parallel ranks.*Trainer\(devices=2\)"):
        unpadded_eval_loader(sharded_loader(2, 3, 0), 3, 0, "ds_test")


def test_integer_means_reduce_in_float() -> None:
    count = torch.tensor(359)
    assert exact_mean_input(count, "mean").dtype == torch.float64
    assert exact_mean_input(count, "sum") is count
    assert exact_mean_input(torch.tensor(0.5), "mean").dtype == torch.float32
    # Lightning's own in-place average truncates: the sample count behind an epoch mean would be 179, not 179.5.
    assert int(count.clone().copy_(count / 2)) == 179
