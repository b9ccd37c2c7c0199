"""Bytes that really cross the process group, logged at each collective the comm hooks launch, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch.testing import assert_close

from ds_lightning.comm import WireLog
from tests.comm import wire_workers
from tests.helpers.runner import free_port

FLOAT32 = 4


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("wire") / "wire.pt"
    mp.spawn(wire_workers.log_every_compression, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=True)


@pytest.mark.multiprocess
def test_plain_all_reduce_sends_every_gradient_in_float32(logged):
    gradient_bytes = sum(p.numel() for p in wire_workers.model().parameters()) * FLOAT32
    measured = logged["none_logged"]
    assert measured["dtypes"] == ["torch.float32"]
    assert measured["steps"] == wire_workers.STEPS
    assert measured["bytes_per_step"] == measured["last_step_bytes"] == gradient_bytes
    # Hookless "none" (the fast default) reports the figure the logged all-reduce measured.
    assert logged["none"]["rounds"] is None
    assert logged["none"]["bytes_per_step"] == logged["none"]["uncompressed_bytes_per_step"] == gradient_bytes


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "dtype"), [("fp16", "torch.float16"), ("bf16", "torch.bfloat16")])
def test_half_width_hooks_send_half_of_none_in_their_own_dtype(logged, name, dtype):
    measured = logged[name]
    assert measured["dtypes"] == [dtype]  # the hook registered for this name is the one that ran
    assert measured["steps"] == measured["rounds"] == wire_workers.STEPS
    assert measured["bytes_per_step"] == logged["none_logged"]["bytes_per_step"] / 2
    tolerance = 1e-2 if name == "bf16" else 1e-3
    for got, mean in zip(measured["grads"], measured["expected"], strict=True):
        assert_close(got, mean, atol=tolerance, rtol=tolerance)


@pytest.mark.multiprocess
def test_powersgd_sends_its_low_rank_factors_after_the_warm_up(logged):
    measured = logged["powersgd"]
    full = logged["none_logged"]["bytes_per_step"]
    compressed = wire_workers.expected_powersgd_bytes(wire_workers.model(), wire_workers.POWERSGD_RANK)
    assert measured["dtypes"] == ["torch.float32"]
    assert compressed == (96 * 2 + 128 * 2 + 74 * 2 + 64 + 64 + 10) * FLOAT32  # every matrix compressed, by hand
    assert measured["last_step_bytes"] == compressed
    # One plain warm-up step (start_iter=1), then compressed steps.
    assert measured["bytes_per_step"] == (full + (wire_workers.STEPS - 1) * compressed) / wire_workers.STEPS
    assert compressed < 0.2 * full


def test_wire_log_counts_bytes_dtypes_and_closed_steps_only():
    wire = WireLog()
    wire.record(torch.zeros(10, dtype=torch.float16))
    wire.record(torch.zeros(3, dtype=torch.float32))
    wire.end_step()
    wire.record(torch.zeros(5, dtype=torch.float16))  # a step still in flight
    assert wire.steps == 1 and wire.last_step_bytes == 32
    assert wire.bytes_per_step == 32.0
    assert wire.dtypes == {"torch.float16", "torch.float32"}
