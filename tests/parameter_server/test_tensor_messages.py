"""Framed messages over a real two-rank gloo group: exact round trip, byte counts, ordering, tags, refusals, deaths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from ds_lightning.parameter_server.tensor_messages import FRAME_BYTES
from tests.helpers import tensor_message_workers
from tests.helpers.runner import free_port

pytestmark = pytest.mark.multiprocess

JOIN_TIMEOUT = 90  # only a guard against a hung worker; the workers' own faulthandler fires at 60 s


def _spawn(target: Any, out: Path) -> list[dict[str, Any] | None]:
    """Run ``target(rank, port, out)`` on ranks 0 and 1; kill both if they do not finish; return what each wrote."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, str(out)), daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(JOIN_TIMEOUT)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = {path.name: path.read_text() for path in sorted(out.glob("rank*.err"))}
    assert not errors, f"a worker failed: {errors}"
    assert [proc.exitcode for proc in procs] == [0, 0], "a worker hung or crashed"
    results = []
    for rank in range(2):
        path = out / f"rank{rank}.pt"
        results.append(torch.load(path, weights_only=True) if path.exists() else None)
    return results


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory) -> tuple[dict[str, Any], dict[str, Any]]:
    sender, receiver = _spawn(tensor_message_workers.exchange, tmp_path_factory.mktemp("wire"))
    assert sender is not None and receiver is not None
    return sender, receiver


def _assert_same_tensors(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got.dtype == want.dtype, index
        assert got.shape == want.shape, index
        assert torch.equal(got, want), index


def test_header_and_tensors_of_every_dtype_arrive_equal(exchanged):
    _, receiver = exchanged
    assert receiver["header"] == tensor_message_workers.HEADER
    assert "_tensors" not in receiver["header"]
    expected = tensor_message_workers.sample_tensors()
    assert {t.dtype for t in expected} >= {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.uint8,
    }
    assert any(t.dim() == 0 for t in expected)
    assert any(t.numel() == 0 for t in expected)
    _assert_same_tensors(receiver["tensors"], expected)


def test_byte_counts_agree_and_equal_frame_plus_tensor_bytes(exchanged):
    sender, receiver = exchanged
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensor_message_workers.sample_tensors())
    assert sender["sent_bytes"] == receiver["received_bytes"] == FRAME_BYTES + tensor_bytes


def test_header_longer_than_the_frame_follows_in_one_more_transfer(exchanged):
    sender, receiver = exchanged
    header, tensors = receiver["long"]
    assert header == tensor_message_workers.long_header()
    _assert_same_tensors(tensors, [torch.arange(5)])
    meta = {**tensor_message_workers.long_header(), "_tensors": [["int64", [5]]], "_inline": False}
    text_bytes = len(json.dumps(meta).encode())
    assert text_bytes > FRAME_BYTES
    assert sender["long_bytes"] == receiver["long_bytes"] == FRAME_BYTES + text_bytes + 5 * 8


def test_a_message_that_fits_the_channel_capacity_is_one_transfer_of_frame_and_tensor_bytes(exchanged):
    _, receiver = exchanged
    raw = receiver["capacity_raw"]
    _, tensors = tensor_message_workers.capacity_messages()[0]
    payload = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    assert torch.equal(raw[FRAME_BYTES : FRAME_BYTES + payload.numel()], payload)
    # The next receive on the channel got the next message, so nothing of the first one followed separately.
    assert receiver["capacity"][0][0] == {"fits": 2}


def test_capacity_channel_messages_arrive_equal_and_never_alias_the_reused_buffer(exchanged):
    sender, receiver = exchanged
    expected = tensor_message_workers.capacity_messages()[1:]
    for (header, tensors, nbytes), (want_header, want_tensors) in zip(receiver["capacity"], expected, strict=True):
        assert header == want_header  # the reserved "_inline" flag is not handed back
        # Later messages reused the receive buffer: equal tensors here mean none of them was a view into it.
        _assert_same_tensors(tensors, want_tensors)
        assert nbytes == FRAME_BYTES + sum(t.numel() * t.element_size() for t in want_tensors)
    assert sender["capacity_bytes"][1:] == [r[2] for r in receiver["capacity"]]


def test_unsupported_dtype_raises_value_error_before_anything_is_sent(exchanged):
    sender, receiver = exchanged
    assert sender["bad_dtype_error"] is not None
    assert "complex64" in sender["bad_dtype_error"]
    # The next message on the same tag is the one sent after the refusal: no frame of the refused one went out.
    header, tensors = receiver["after_bad"]
    assert header == {"after": "bad"}
    _assert_same_tensors(tensors, [torch.ones(2)])


def test_back_to_back_messages_on_one_tag_arrive_in_order(exchanged):
    _, receiver = exchanged
    assert [header["seq"] for header, _ in receiver["order"]] == list(range(tensor_message_workers.ORDER_COUNT))
    for seq, (header, tensors) in enumerate(receiver["order"]):
        expected_header, expected_tensors = tensor_message_workers.order_message(seq)
        assert header == expected_header
        _assert_same_tensors(tensors, expected_tensors)


def test_messages_on_two_tags_do_not_interleave(exchanged):
    _, receiver = exchanged
    for channel in ("a", "b"):
        received = receiver[f"channel_{channel}"]
        assert len(received) == tensor_message_workers.CHANNEL_COUNT
        for seq, (header, tensors) in enumerate(received):
            expected_header, expected_tensors = tensor_message_workers.channel_message(channel, seq)
            assert header == expected_header
            _assert_same_tensors(tensors, expected_tensors)


def test_receive_from_a_peer_that_exits_raises_instead_of_hanging(exchanged):
    sender, _ = exchanged
    assert sender["goodbye"] == {"goodbye": True}
    assert sender["dead_peer_error"] is not None, "recv_message returned although the peer was gone"
    assert sender["dead_peer_error"][0] == "RuntimeError", sender["dead_peer_error"]
    assert sender["dead_peer_seconds"] < 20  # the group's timeout is 30 s: the closed connection ended the wait
