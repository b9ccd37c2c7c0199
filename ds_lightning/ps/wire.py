"""Framed messages of tensors over one c10d gloo process group: a JSON header and a list of tensors.

Only tensors cross the wire. The header travels as a ``uint8`` tensor holding UTF-8 JSON, which is parsed with
:func:`json.loads`, never unpickled, and it declares the dtype and shape of every tensor that follows, so the receiver
allocates its buffers before the data arrives. One message is three or more point-to-point transfers on one tag;
gloo keeps the order of transfers between two ranks on one tag, so messages never interleave.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)
}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent; use one of {sorted(_DTYPES)}.")
    return name


def send_message(pg: Any, dst: int, tag: int, header: dict[str, Any], tensors: Sequence[Tensor] = ()) -> int:
    """Send ``header`` and ``tensors`` to rank ``dst`` and wait until gloo has taken them (see :func:`post_message`).

    Returns:
        The number of bytes sent, header included.

    """
    nbytes, pending = post_message(pg, dst, tag, header, tensors)
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
    pg: Any, dst: int, tag: int, header: dict[str, Any], tensors: Sequence[Tensor] = ()
) -> tuple[int, Pending]:
    """Start sending ``header`` and ``tensors`` to rank ``dst`` without waiting.

    Args:
        pg: the gloo process group (``torch.distributed.ProcessGroupGloo``).
        dst: the receiving rank in ``pg``.
        tag: the tag of this channel; the receiver must use the same one.
        header: JSON-serialisable fields. The key ``"_tensors"`` is reserved.
        tensors: CPU tensors to send after the header.

    Returns:
        The number of bytes sent, header included, and the :class:`Pending` transfers to wait for.

    """
    tensors = [t.detach().contiguous() for t in tensors]
    meta = dict(header)
    meta["_tensors"] = [[_dtype_name(t.dtype), list(t.shape)] for t in tensors]
    blob = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    size = torch.tensor([blob.numel()], dtype=torch.int64)
    works = [pg.send([size], dst, tag), pg.send([blob], dst, tag)]
    works += [pg.send([t], dst, tag) for t in tensors if t.numel() > 0]
    nbytes = 8 + blob.numel() + sum(t.numel() * t.element_size() for t in tensors)
    return nbytes, Pending(works, [size, blob, *tensors])


def recv_message(pg: Any, src: int, tag: int) -> tuple[dict[str, Any], list[Tensor], int]:
    """Receive one message sent by :func:`send_message` from rank ``src``.

    Returns:
        The header (without ``"_tensors"``), the tensors, and the number of bytes received.

    Raises:
        RuntimeError: from gloo when ``src`` is gone (its connection closed) or the group's timeout passes.
        ValueError: when the header is not the JSON object this module writes.

    """
    size = torch.empty(1, dtype=torch.int64)
    pg.recv([size], src, tag).wait()
    blob = torch.empty(int(size.item()), dtype=torch.uint8)
    pg.recv([blob], src, tag).wait()
    meta = json.loads(bytes(blob.numpy()).decode())
    if not isinstance(meta, dict) or not isinstance(meta.get("_tensors"), list):
        raise ValueError(f"rank {src} sent a message without a tensor list; both ends must run the same ds_lightning.")
    tensors = []
    for dtype_name, shape in meta.pop("_tensors"):
        tensors.append(torch.empty([int(n) for n in shape], dtype=_DTYPES[dtype_name]))
    works = [pg.recv([t], src, tag) for t in tensors if t.numel() > 0]
    for work in works:
        work.wait()
    return meta, tensors, 8 + blob.numel() + sum(t.numel() * t.element_size() for t in tensors)
