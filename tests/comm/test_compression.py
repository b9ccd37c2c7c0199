"""Gradient compression: option checks, PowerSGD exactness at full rank across processes, state round trip."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch.testing import assert_close

from ds_lightning.comm import GradientCompressor
from ds_lightning.comm.compression.powersgd import PowerSGDState
from tests.helpers import dist_workers
from tests.helpers.runner import free_port


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "topk"}, "gradient_compression='topk'"),
        ({"name": "powersgd", "powersgd_rank": 0}, "powersgd_rank=0"),
        ({"name": "powersgd", "powersgd_rank": True}, "powersgd_rank=True"),
        ({"name": "powersgd", "powersgd_start_iter": -2}, "powersgd_start_iter=-2"),
        ({"name": "powersgd", "powersgd_min_compression_rate": 0}, "powersgd_min_compression_rate=0"),
    ],
)
def test_bad_compression_options_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradientCompressor(**kwargs)


@pytest.mark.multiprocess
def test_full_rank_powersgd_equals_plain_all_reduce_mean(tmp_path):
    out = tmp_path / "result.pt"
    mp.spawn(dist_workers.full_rank_powersgd_equals_mean, args=(2, free_port(), str(out)), nprocs=2, join=True)
    saved = torch.load(out, weights_only=True)
    for got, expected in saved["results"]:
        for g, e in zip(got, expected, strict=True):
            assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_powersgd_state_round_trips_through_weights_only_load(tmp_path):
    state = PowerSGDState(rank=2)
    state.iter = 7
    state.error = {0: torch.randn(4, 3), 2: torch.randn(5, 2)}
    state.q_memory = {0: torch.randn(3, 2)}
    path = tmp_path / "state.pt"
    torch.save(state.state_dict(), path)
    restored = PowerSGDState(rank=2)
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert restored.iter == 7
    assert restored.error.keys() == state.error.keys()
    for key, value in state.error.items():
        assert torch.equal(restored.error[key], value)
    assert torch.equal(restored.q_memory[0], state.q_memory[0])


def test_state_for_another_setting_is_refused():
    compressor = GradientCompressor("fp16")
    with pytest.raises(ValueError, match="saved for 'powersgd'"):
        compressor.load_state_dict({"name": "powersgd"})


def test_states_in_the_checkpoint_format_of_earlier_releases_still_load(tmp_path, one_rank_group):
    """The per-rank entries of ``checkpoint["ds_mirrored"]["compression_states"]`` as earlier releases wrote them:
    PowerSGD's keys at the top level, auto's PowerSGD memory under ``"powersgd"``. Both restore into today's methods."""
    from torch.nn.parallel import DistributedDataParallel

    error, q = torch.randn(16, 8), torch.randn(8, 2)
    powersgd = {"name": "powersgd", "iter": 7, "error": {0: error}, "q_memory": {0: q}}
    figures = {
        "world_size": 1,
        "float32": {"latency_s": 1e-5, "bandwidth": 1e9},
        "float16": {"latency_s": 1e-5, "bandwidth": 5e8},
        "compress_s": {"fp16": 1e-4, "powersgd": 2e-3},
    }
    memory = {k: v for k, v in powersgd.items() if k != "name"}
    auto = {"name": "auto", "choice": "fp16", "step": 6, "figures": figures, "powersgd": memory}
    compressors = {}
    for name, saved in (("powersgd", powersgd), ("auto", auto)):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
        compressor = GradientCompressor(name, powersgd_start_iter=10)
        compressor.register(model)
        path = tmp_path / f"{name}.pt"
        torch.save(saved, path)
        compressor.load_state_dict(torch.load(path, weights_only=True))
        compressors[name] = compressor
    state = compressors["powersgd"].method.state
    assert state.iter == 7 and torch.equal(state.error[0], error) and torch.equal(state.q_memory[0], q)
    restored = compressors["auto"].auto
    assert restored.choice == "fp16" and restored.step == 6 and restored.figures.float16.bandwidth == 5e8
    memory = compressors["auto"].state_dict()["powersgd"]
    assert memory["iter"] == 7 and torch.equal(memory["error"][0], error) and torch.equal(memory["q_memory"][0], q)
    assert compressors["auto"].state_dict().keys() == {"name", "choice", "step", "figures", "powersgd"}
