"""Framed messages of tensors over one c10d gloo process group: a JSON header and a list of tensors.

Only tensors cross the wire. The header travels in a fixed-size ``uint8`` frame holding UTF-8 JSON, which is parsed
with :func:`json.loads`, never unpickled, and it declares the dtype and shape of every tensor that follows, so the
receiver allocates its buffers before the data arrives.

Each transfer costs a wake-up at both ends, so a message uses as few as it can. Both ends of a channel agree on a
``capacity`` (at least :data:`FRAME_BYTES`), and the receiver always posts its first receive with that many bytes
(gloo accepts a shorter message into a longer buffer). A message whose frame and tensor bytes fit in the capacity
travels as that one transfer; otherwise the frame goes alone and every non-empty tensor follows in its own transfer,
preceded by the header's JSON when that is too long for the frame (checkpoint state). All transfers of a message use
one tag; gloo keeps the order of transfers between two ranks on one tag, so messages never interleave.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

#: Bytes of the header frame: a 4-byte little-endian JSON length, then the JSON (or nothing, when it overflows).
FRAME_BYTES = 2048
_LENGTH_BYTES = 4
#: The most tensor bytes :func:`channel_capacity` lets one transfer carry with its frame.
INLINE_MAX_BYTES = 1 << 20

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)
}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent; use one of {sorted(_DTYPES)}.")
    return name


def send_message(
    pg: Any, dst: int, tag: int, header: dict[str, Any], tensors: Sequence[Tensor] = (), capacity: int = FRAME_BYTES
) -> int:
    """Send ``header`` and ``tensors`` to rank ``dst`` and wait until gloo has taken them (see :func:`post_message`).

    Returns:
        The number of bytes sent, header frame included.

    """
    nbytes, pending = post_message(pg, dst, tag, header, tensors, capacity)
    pending.wait()
    return nbytes


class Pending:
    """Transfers in flight, and the buffers they read from, which must stay alive until they complete."""

    def __init__(self, works: list[Any], buffers: list[Tensor]) -> None:
        self.works = works
        self.buffers = buffers

    def wait(self) -> None:
        """Block until every transfer completed; raises what gloo raises (a dead peer, the timeout)."""
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], []


def post_message(
    pg: Any, dst: int, tag: int, header: dict[str, Any], tensors: Sequence[Tensor] = (), capacity: int = FRAME_BYTES
) -> tuple[int, Pending]:
    """Start sending ``header`` and ``tensors`` to rank ``dst`` without waiting.

    Args:
        pg: the gloo process group (``torch.distributed.ProcessGroupGloo``).
        dst: the receiving rank in ``pg``.
        tag: the tag of this channel; the receiver must use the same one.
        header: JSON-serialisable fields. The keys ``"_tensors"`` and ``"_inline"`` are reserved.
        tensors: CPU tensors to send after the header.
        capacity: the channel's first-transfer size, the same at both ends (see the module's docstring).

    Returns:
        The number of bytes sent, header frame included, and the :class:`Pending` transfers to wait for.

    """
    tensors = [t.detach().contiguous() for t in tensors]
    meta = dict(header)
    meta["_tensors"] = [[_dtype_name(t.dtype), list(t.shape)] for t in tensors]
    payload = sum(t.numel() * t.element_size() for t in tensors)
    text = json.dumps({**meta, "_inline": True}).encode()
    inline = len(text) <= FRAME_BYTES - _LENGTH_BYTES and FRAME_BYTES + payload <= capacity
    if not inline:
        text = json.dumps({**meta, "_inline": False}).encode()
    first = torch.zeros(FRAME_BYTES + (payload if inline else 0), dtype=torch.uint8)
    first[:_LENGTH_BYTES] = torch.frombuffer(bytearray(len(text).to_bytes(_LENGTH_BYTES, "little")), dtype=torch.uint8)
    buffers = [first]
    if len(text) <= FRAME_BYTES - _LENGTH_BYTES:
        first[_LENGTH_BYTES : _LENGTH_BYTES + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    else:
        buffers.append(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    if inline:
        offset = FRAME_BYTES
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            first[offset : offset + nbytes] = t.reshape(-1).view(torch.uint8)
            offset += nbytes
    else:
        buffers += [t for t in tensors if t.numel() > 0]
    works = [pg.send([buffer], dst, tag) for buffer in buffers]
    return sum(b.numel() * b.element_size() for b in buffers), Pending(works, buffers)


def recv_message(
    pg: Any, src: int, tag: int, capacity: int = FRAME_BYTES, buffer: Tensor | None = None
) -> tuple[dict[str, Any], list[Tensor], int]:
    """Receive one message sent by :func:`send_message` or :func:`post_message` from rank ``src``.

    Args:
        pg: the gloo process group.
        src: the sending rank.
        tag: the channel's tag.
        capacity: the channel's first-transfer size, as the sender uses it.
        buffer: a ``uint8`` tensor of ``capacity`` bytes to receive into, reused across calls (the tensors returned
            never alias it); ``None`` allocates one.

    Returns:
        The header (without the reserved keys), the tensors, and the number of bytes received.

    Raises:
        RuntimeError: from gloo when ``src`` is gone (its connection closed) or the group's timeout passes.
        ValueError: when the header is not the JSON object this module writes.

    """
    if capacity < FRAME_BYTES:
        raise ValueError(f"capacity={capacity} must be at least FRAME_BYTES={FRAME_BYTES}.")
    if buffer is None or buffer.numel() != capacity or buffer.dtype != torch.uint8:
        buffer = torch.empty(capacity, dtype=torch.uint8)
    pg.recv([buffer], src, tag).wait()
    raw = buffer[:FRAME_BYTES].numpy().tobytes()
    length = int.from_bytes(raw[:_LENGTH_BYTES], "little")
    nbytes = FRAME_BYTES
    if length <= FRAME_BYTES - _LENGTH_BYTES:
        text = raw[_LENGTH_BYTES : _LENGTH_BYTES + length]
    else:
        blob = torch.empty(length, dtype=torch.uint8)
        pg.recv([blob], src, tag).wait()
        text, nbytes = blob.numpy().tobytes(), nbytes + length
    meta = json.loads(text.decode())
    if not isinstance(meta, dict) or not isinstance(meta.get("_tensors"), list):
        raise ValueError(f"rank {src} sent a message without a tensor list; both ends must run the same ds_lightning.")
    tensors = [torch.empty([int(n) for n in shape], dtype=_DTYPES[name]) for name, shape in meta.pop("_tensors")]
    if meta.pop("_inline", False):
        offset = FRAME_BYTES
        for t in tensors:
            size = t.numel() * t.element_size()
            t.reshape(-1).view(torch.uint8).copy_(buffer[offset : offset + size])
            offset += size
    else:
        works = [pg.recv([t], src, tag) for t in tensors if t.numel() > 0]
        for work in works:
            work.wait()
    return meta, tensors, nbytes + sum(t.numel() * t.element_size() for t in tensors)


def channel_capacity(payload_bytes: int) -> int:
    """The capacity of a channel whose usual message carries ``payload_bytes`` of tensors (capped at 1 MiB).

    Past that size a transfer's wake-up costs little next to the copy into one buffer, so bigger messages go as
    separate transfers.
    """
    return FRAME_BYTES + max(0, min(int(payload_bytes), INLINE_MAX_BYTES))
