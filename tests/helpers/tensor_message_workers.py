"""Two-rank gloo workers for the parameter server's framed tensor messages (see test_tensor_messages.py).

Each worker builds its own process group on a ``TCPStore``, runs the scenario and writes what it saw into ``out``
(``rank<N>.pt``, loaded with ``weights_only=True``); a worker that fails writes its traceback to ``rank<N>.err``.
Workers leave with ``os._exit`` so that tearing the group down never blocks the test. Everything runs in one pair of
processes because each one spends most of its time importing ``ds_lightning`` (and with it Lightning).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_lightning.parameter_server.tensor_messages import FRAME_BYTES, recv_message, send_message

GROUP_TIMEOUT = timedelta(seconds=30)
MAIN_TAG, ORDER_TAG, TAG_A, TAG_B, DONE_TAG, CAPACITY_TAG = 1, 2, 21, 22, 3, 4
ORDER_COUNT = 6
CHANNEL_COUNT = 5

HEADER: dict[str, Any] = {
    "kind": "push",
    "step": 7,
    "lr": 0.1,
    "scale": -2.5e-8,
    "text": 'héllo ✓ "quoted"',
    "nested": {"list": [1, [2.5, "x", None, True]], "empty": [], "deep": {"names": ["a", "b"]}},
}


def sample_tensors() -> list[torch.Tensor]:
    """Every wire dtype, a 0-d and an empty tensor, extreme integers and a non-contiguous view."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=gen),
        torch.randn(5, generator=gen, dtype=torch.float64),
        torch.randn(2, 3, 2, generator=gen).to(torch.float16),
        torch.randn(7, generator=gen).to(torch.bfloat16),
        torch.tensor([0, -1, 2**40, -(2**62), 2**63 - 1], dtype=torch.int64),
        torch.tensor([-(2**31), 2**31 - 1, 0], dtype=torch.int32),
        torch.arange(256, dtype=torch.int64).to(torch.uint8).view(16, 16),
        torch.tensor(3.5),
        torch.empty(0, 3),
        torch.randn(4, 6, generator=gen).t(),  # non-contiguous
    ]


def long_header() -> dict[str, Any]:
    """A header longer than the wire's fixed frame (what a checkpoint's state reply looks like)."""
    return {"entries": [[index, f"exp_avg_{index}"] for index in range(300)], "text": "é" * 500}


CAPACITY = FRAME_BYTES + 100  # room for 100 tensor bytes in the first transfer


def capacity_messages() -> list[tuple[dict[str, Any], list[torch.Tensor]]]:
    """Messages for a channel with :data:`CAPACITY`: fits, fits exactly, too big by one byte, no tensors."""
    return [
        ({"fits": 1}, [torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.tensor([2**40]), torch.tensor(7.0)]),
        ({"fits": 2}, [torch.arange(100, dtype=torch.int64).to(torch.uint8)]),
        ({"fits": 0}, [torch.arange(101, dtype=torch.int64).to(torch.uint8), torch.ones(2)]),
        ({"fits": 3}, []),
    ]


def order_message(seq: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    return {"seq": seq}, [torch.full((seq,), float(seq)), torch.arange(seq + 1)]


def channel_message(channel: str, seq: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Channel "a" sends long float32 vectors, channel "b" small float64 matrices and a byte, so a mix-up shows."""
    if channel == "a":
        return {"channel": "a", "seq": seq}, [torch.full((1000 + seq,), float(seq))]
    return {"channel": "b", "seq": seq}, [
        torch.full((seq + 1, 3), -float(seq), dtype=torch.float64),
        torch.tensor([seq], dtype=torch.uint8),
    ]


def _group(rank: int, port: int) -> Any:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=GROUP_TIMEOUT)
    return dist.ProcessGroupGloo(dist.PrefixStore("t/", store), rank, 2, GROUP_TIMEOUT)


def _run(rank: int, out: str, body: Callable[[Callable[[dict[str, Any]], None]], None]) -> None:
    """Run ``body(save)`` under a hang guard; ``save`` writes the rank's results. Leave with ``os._exit``."""
    faulthandler.dump_traceback_later(60, exit=True, file=sys.stderr)
    torch.set_num_threads(1)

    def save(result: dict[str, Any]) -> None:
        torch.save(result, Path(out) / f"rank{rank}.pt")

    try:
        body(save)
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)


def exchange(rank: int, port: int, out: str) -> None:
    """Rank 0 sends, rank 1 receives: one full message, a refused dtype, an ordered burst, two concurrent tags.

    At the end rank 1 says goodbye on ``DONE_TAG`` and exits abruptly (``os._exit``) while rank 0 waits in
    ``recv_message`` for one more message from it; rank 0 records how that receive ended.
    """

    def sender(save: Callable[[dict[str, Any]], None]) -> None:
        pg = _group(rank, port)
        result: dict[str, Any] = {"sent_bytes": send_message(pg, 1, MAIN_TAG, HEADER, sample_tensors())}
        try:
            send_message(pg, 1, MAIN_TAG, {"bad": True}, [torch.zeros(2), torch.zeros(3, dtype=torch.complex64)])
            result["bad_dtype_error"] = None
        except ValueError as error:
            result["bad_dtype_error"] = str(error)
        send_message(pg, 1, MAIN_TAG, {"after": "bad"}, [torch.ones(2)])
        result["long_bytes"] = send_message(pg, 1, MAIN_TAG, long_header(), [torch.arange(5)])
        result["capacity_bytes"] = [send_message(pg, 1, CAPACITY_TAG, *m, CAPACITY) for m in capacity_messages()]
        for seq in range(ORDER_COUNT):
            send_message(pg, 1, ORDER_TAG, *order_message(seq))

        failures: list[BaseException] = []

        def channel(name: str, tag: int) -> None:
            try:
                for seq in range(CHANNEL_COUNT):
                    send_message(pg, 1, tag, *channel_message(name, seq))
            except BaseException as error:
                failures.append(error)

        threads = [threading.Thread(target=channel, args=args) for args in (("a", TAG_A), ("b", TAG_B))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]

        result["goodbye"] = recv_message(pg, 1, DONE_TAG)[0]
        send_message(pg, 1, DONE_TAG, {"ack": True})
        start = time.monotonic()
        try:
            recv_message(pg, 1, DONE_TAG)
            result["dead_peer_error"] = None
        except Exception as error:
            result["dead_peer_error"] = [type(error).__name__, str(error)[:500]]
        result["dead_peer_seconds"] = time.monotonic() - start
        save(result)

    def receiver(save: Callable[[dict[str, Any]], None]) -> None:
        pg = _group(rank, port)
        header, tensors, received = recv_message(pg, 0, MAIN_TAG)
        result: dict[str, Any] = {"header": header, "tensors": tensors, "received_bytes": received}
        result["after_bad"] = recv_message(pg, 0, MAIN_TAG)[:2]
        *result["long"], result["long_bytes"] = recv_message(pg, 0, MAIN_TAG)
        buffer = torch.empty(CAPACITY, dtype=torch.uint8)  # reused by every receive below
        # The first message's single transfer, read raw: frame, then the tensors' bytes right behind it.
        pg.recv([buffer], 0, CAPACITY_TAG).wait()
        result["capacity_raw"] = buffer.clone()
        result["capacity"] = [recv_message(pg, 0, CAPACITY_TAG, CAPACITY, buffer) for _ in capacity_messages()[1:]]
        result["order"] = [recv_message(pg, 0, ORDER_TAG)[:2] for _ in range(ORDER_COUNT)]
        # All of channel "b" first, although "a" runs concurrently: each tag must only yield its own messages.
        result["channel_b"] = [recv_message(pg, 0, TAG_B)[:2] for _ in range(CHANNEL_COUNT)]
        result["channel_a"] = [recv_message(pg, 0, TAG_A)[:2] for _ in range(CHANNEL_COUNT)]
        save(result)
        send_message(pg, 0, DONE_TAG, {"goodbye": True})
        recv_message(pg, 0, DONE_TAG)
        time.sleep(0.5)  # let rank 0 block in its receive first
        sys.stderr.flush()
        os._exit(0)  # no destroy_process_group, no goodbye frame: the connection just closes

    _run(rank, out, sender if rank == 0 else receiver)
