"""Partition a model's parameters across parameter servers, balanced by size, with a deterministic flat layout.

Every process computes the same :class:`ParameterShardPlan` from the same parameter names, shapes and dtypes, so no
plan needs to travel between processes; :meth:`ParameterShardPlan.fingerprint` (one int64) or
:meth:`ParameterShardPlan.to_tensor` lets them check that with a tensor collective, without pickling.

Splitting follows TensorFlow's ``MinSizePartitioner``: a tensor of at least ``2 * min_shard_bytes`` with more than
one row is cut along dim 0 into as many nearly equal row blocks as possible while every block keeps at least
``min_shard_bytes`` and there are no more blocks than servers (or ``max_shards_per_tensor``). The pieces are then
placed largest first, each tensor's blocks at once on distinct servers, on the least-loaded servers (list
scheduling, Graham's LPT). Within a server the pieces are laid out in parameter order, then row order; that layout
is the server's flat buffer, built by :meth:`ParameterShardPlan.flatten` and read back by
:meth:`ParameterShardPlan.unflatten_into`.

Balance guarantee, in elements (one flat buffer has one dtype, so bytes on the wire are elements times the wire
dtype's size; see :meth:`ParameterShardPlan.bytes_per_server`). With ``m`` servers, ``W`` elements in all and ``P``
elements in the largest piece:

* ``max_load - min_load <= P`` after every placement, hence ``max_load <= W / m + (1 - 1 / m) * P``. Since no
  placement can beat ``max(W / m, P)``, that is at most ``2 - 1 / m`` times the optimum.
* When no tensor is split the procedure is exactly LPT, and ``max_load <= (4 / 3 - 1 / (3 * m))`` times the optimum.
* So a model of many equal, unsplit tensors gives server loads that differ by at most one tensor.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["ParameterShardPlan", "ShardSlice", "plan_shards"]

_MAGIC = 0x5053_504C_414E  # b"PSPLAN"
_VERSION = 1


@dataclass(frozen=True)
class ShardSlice:
    """One contiguous piece of one parameter that lives on one server.

    Attributes:
        name: the parameter's name, as ``module.named_parameters()`` gives it.
        server: the index of the server that holds the piece.
        rows: ``[start, stop)`` along dim 0; the whole tensor is ``(0, shape[0])``, and ``(0, 1)`` for a scalar.
        shape: the shape of the piece.
        offset: the element offset of the piece inside its server's flat buffer.
        numel: the number of elements of the piece.

    """

    name: str
    server: int
    rows: tuple[int, int]
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class ParameterShardPlan:
    """Which rows of which parameter live on which server, and where in that server's flat buffer.

    ``slices`` are in parameter order, then row order; a server's slices, in that order, make up its flat buffer
    with contiguous offsets from 0. Build plans with :func:`plan_shards`; the constructor only checks consistency.

    Args:
        num_servers: the number of parameter servers.
        slices: every piece of every parameter.

    Raises:
        ValueError: if ``num_servers < 1`` or the slices are inconsistent (a server out of range, offsets that are
            not contiguous, a shape that does not match ``rows`` or ``numel``, overlapping rows of one parameter).

    """

    num_servers: int
    slices: tuple[ShardSlice, ...]
    _by_server: tuple[tuple[ShardSlice, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_positive_int("num_servers", self.num_servers, "start at least one parameter server, num_servers=1")
        by_server: list[list[ShardSlice]] = [[] for _ in range(self.num_servers)]
        ends = [0] * self.num_servers
        rows_of: dict[str, list[tuple[int, int]]] = {}
        for piece in self.slices:
            if not 0 <= piece.server < self.num_servers:
                raise ValueError(
                    f"Slice {piece} sits on server {piece.server} but the plan has {self.num_servers} servers "
                    f"(0..{self.num_servers - 1}); rebuild the plan with plan_shards()."
                )
            if piece.offset != ends[piece.server]:
                raise ValueError(
                    f"Slice {piece} starts at offset {piece.offset} but server {piece.server}'s buffer ends at "
                    f"{ends[piece.server]}; offsets must be contiguous in plan order. Rebuild it with plan_shards()."
                )
            start, stop = piece.rows
            expected_rows = piece.shape[0] if piece.shape else 1
            if not 0 <= start <= stop or stop - start != expected_rows or piece.numel != math.prod(piece.shape):
                raise ValueError(
                    f"Slice {piece} is inconsistent: rows {piece.rows} must span shape[0] rows (1 for a scalar) and "
                    f"numel must be the product of shape. Rebuild the plan with plan_shards()."
                )
            by_server[piece.server].append(piece)
            ends[piece.server] += piece.numel
            rows_of.setdefault(piece.name, []).append(piece.rows)
        for name, ranges in rows_of.items():
            ordered = sorted(ranges)
            if any(prev[1] > cur[0] for prev, cur in itertools.pairwise(ordered)):
                raise ValueError(
                    f"Parameter {name!r} has overlapping row blocks {ordered}; rebuild with plan_shards()."
                )
        object.__setattr__(self, "_by_server", tuple(tuple(group) for group in by_server))

    def server_slices(self, server: int) -> tuple[ShardSlice, ...]:
        """The pieces on ``server``, in flat-buffer order."""
        self._check_server(server)
        return self._by_server[server]

    def server_numel(self, server: int) -> int:
        """The number of elements in ``server``'s flat buffer."""
        return sum(piece.numel for piece in self.server_slices(server))

    def bytes_per_server(self, element_size: int = 4) -> list[int]:
        """The size of each server's flat buffer in bytes, for a wire dtype of ``element_size`` bytes.

        For a plan from :func:`plan_shards`, with ``P`` the largest piece in bytes, ``max - min <= P`` and
        ``max <= sum / num_servers + (1 - 1 / num_servers) * P`` (see the module docstring).
        """
        _check_positive_int("element_size", element_size, "pass the wire dtype's size, e.g. element_size=4 for fp32")
        return [self.server_numel(server) * element_size for server in range(self.num_servers)]

    def flatten(self, tensors: Mapping[str, Tensor], server: int) -> Tensor:
        """Gather ``server``'s pieces of ``tensors`` into one new 1-D buffer, in plan order.

        Works for parameters and for gradients alike; the result is detached and has the inputs' dtype and device.

        Args:
            tensors: full tensors by parameter name (``dict(model.named_parameters())``, or the gradients).
            server: the server whose buffer to build.

        Raises:
            KeyError: if a name of the plan is missing from ``tensors``.
            TypeError: if an entry is not a tensor (e.g. a ``None`` gradient) or the server's pieces mix dtypes.
            ValueError: if a tensor's shape does not fit the plan.

        """
        pieces = [_rows_of(_lookup(tensors, piece.name), piece).reshape(-1) for piece in self.server_slices(server)]
        if not pieces:
            sample = next(iter(tensors.values()), None)
            if isinstance(sample, Tensor):
                return torch.empty(0, dtype=sample.dtype, device=sample.device)
            return torch.empty(0)
        dtypes = sorted({str(p.dtype) for p in pieces})
        if len(dtypes) > 1:
            names = [f"{piece.name}: {tensors[piece.name].dtype}" for piece in self.server_slices(server)]
            raise TypeError(
                f"Server {server}'s pieces mix dtypes {dtypes} ({names}); one flat buffer holds one dtype. Cast the "
                f"tensors to one dtype before flatten(), e.g. {{n: t.float() for n, t in tensors.items()}}."
            )
        with torch.no_grad():
            return torch.cat(pieces)

    def unflatten_into(self, buffer: Tensor, server: int, tensors: Mapping[str, Tensor]) -> None:
        """Copy ``server``'s flat ``buffer`` back into the right rows of ``tensors``, in place and without autograd.

        Args:
            buffer: a 1-D tensor of :meth:`server_numel` elements, laid out as :meth:`flatten` builds it.
            server: the server the buffer belongs to.
            tensors: full tensors by parameter name, written in place (values are cast to their dtype).

        Raises:
            KeyError: if a name of the plan is missing from ``tensors``.
            ValueError: if ``buffer`` is not 1-D with the server's element count, or a tensor does not fit the plan.

        """
        expected = self.server_numel(server)
        if buffer.dim() != 1 or buffer.numel() != expected:
            raise ValueError(
                f"Server {server}'s buffer must be 1-D with {expected} elements, got shape {tuple(buffer.shape)}; "
                f"build it with plan.flatten(tensors, {server}) or torch.empty(plan.server_numel({server}))."
            )
        with torch.no_grad():
            for piece in self.server_slices(server):
                target = _rows_of(_lookup(tensors, piece.name), piece)
                target.copy_(buffer[piece.offset : piece.offset + piece.numel].reshape(piece.shape))

    def to_tensor(self) -> Tensor:
        """Encode the plan as a 1-D int64 tensor (names as UTF-8 code units), for broadcast or comparison."""
        return torch.tensor(self._encode(), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: Tensor) -> ParameterShardPlan:
        """Decode a plan made by :meth:`to_tensor`.

        Raises:
            ValueError: if ``tensor`` is not a 1-D int64 encoding of a plan.

        """
        if tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise ValueError(
                f"A plan encoding is a 1-D int64 tensor, got dtype {tensor.dtype} and shape {tuple(tensor.shape)}; "
                f"pass what ParameterShardPlan.to_tensor() returned."
            )
        values = tensor.detach().cpu().tolist()
        if values[:2] != [_MAGIC, _VERSION] or len(values) < 4:
            raise ValueError(
                f"This tensor is not a ParameterShardPlan encoding (version {_VERSION}): it starts with {values[:4]}; "
                f"pass what ParameterShardPlan.to_tensor() returned."
            )
        num_servers, count = values[2], values[3]
        slices, at = [], 4
        try:
            for _ in range(count):
                server, start, stop, offset, numel, ndim = values[at : at + 6]
                shape = tuple(values[at + 6 : at + 6 + ndim])
                at += 6 + ndim
                length = values[at]
                name = bytes(values[at + 1 : at + 1 + length]).decode("utf-8")
                at += 1 + length
                if len(shape) != ndim or len(name.encode("utf-8")) != length:
                    raise ValueError("truncated")
                slices.append(ShardSlice(name, server, (start, stop), shape, offset, numel))
        except (ValueError, IndexError) as error:
            raise ValueError(
                f"The plan encoding is truncated or corrupt near position {at} of {len(values)} ({error}); pass "
                f"the whole tensor that ParameterShardPlan.to_tensor() returned."
            ) from error
        if at != len(values):
            raise ValueError(f"The plan encoding has {len(values) - at} trailing values after {count} slices.")
        return cls(num_servers, tuple(slices))

    def fingerprint(self) -> int:
        """A deterministic 63-bit hash of the plan (BLAKE2b over its int64 encoding), equal across processes."""
        values = self._encode()
        digest = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 63) - 1)

    def _encode(self) -> list[int]:
        values = [_MAGIC, _VERSION, self.num_servers, len(self.slices)]
        for piece in self.slices:
            name = piece.name.encode("utf-8")
            values += [piece.server, *piece.rows, piece.offset, piece.numel, len(piece.shape), *piece.shape]
            values += [len(name), *name]
        return values

    def _check_server(self, server: int) -> None:
        if isinstance(server, bool) or not isinstance(server, int) or not 0 <= server < self.num_servers:
            raise ValueError(
                f"server={server!r} is out of range: the plan has {self.num_servers} servers, "
                f"pass 0..{self.num_servers - 1}."
            )


def plan_shards(
    params: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    num_servers: int,
    min_shard_bytes: int = 256 * 1024,
    max_shards_per_tensor: int | None = None,
) -> ParameterShardPlan:
    """Partition ``params`` across ``num_servers`` servers, balanced by size.

    Only names, shapes and dtypes are read, so meta tensors work. The plan is a pure function of the sequence of
    ``(name, shape, dtype)``: a mapping and a list of the same pairs in the same order give the same plan, and so
    does every process of a job. The order matters (it breaks ties and lays out the buffers), so pass
    ``model.named_parameters()``, whose order is fixed by the model's code.

    Args:
        params: ``model.named_parameters()``, a list of ``(name, tensor)`` pairs, or a name-to-tensor mapping.
        num_servers: the number of parameter servers.
        min_shard_bytes: a tensor of at least twice this size (in its own dtype) with more than one row is split
            into row blocks of at least this size each, like TensorFlow's ``MinSizePartitioner``.
        max_shards_per_tensor: an upper bound on the blocks per tensor (``None``: only ``num_servers`` bounds it).

    Returns:
        The plan; see the module docstring for the placement rule and its balance guarantee.

    Raises:
        ValueError: if ``num_servers``, ``min_shard_bytes`` or ``max_shards_per_tensor`` is not a positive integer,
            if there are no parameters, or if a name repeats.
        TypeError: if an entry is not a ``(str, Tensor)`` pair or a tensor is not floating point.

    """
    _check_positive_int("num_servers", num_servers, "start at least one parameter server, num_servers=1")
    _check_positive_int("min_shard_bytes", min_shard_bytes, "e.g. min_shard_bytes=256 * 1024 (TensorFlow's default)")
    if max_shards_per_tensor is not None:
        _check_positive_int(
            "max_shards_per_tensor", max_shards_per_tensor, "pass None for no cap, or 1 to never split a tensor"
        )
    entries = _collect(params)
    cap = min(num_servers, max_shards_per_tensor or num_servers)

    # One group per parameter: its row blocks, largest first (the first blocks take the remainder rows).
    groups = [_row_blocks(shape, element_size, cap, min_shard_bytes) for _, shape, element_size in entries]
    order = sorted(range(len(entries)), key=lambda index: (-_block_numel(entries[index][1], groups[index][0]), index))

    heap = [(0, server) for server in range(num_servers)]  # (load in elements, server): least loaded, lowest index
    placed: list[tuple[int, int, int, tuple[int, int]]] = []  # (server, parameter index, row start, rows)
    for index in order:
        targets = [heapq.heappop(heap) for _ in groups[index]]  # distinct servers, least loaded first
        for (load, server), rows in zip(targets, groups[index], strict=True):
            heapq.heappush(heap, (load + _block_numel(entries[index][1], rows), server))
            placed.append((server, index, rows[0], rows))

    offsets = [0] * num_servers
    located: dict[tuple[int, int], tuple[int, int]] = {}
    for server, index, start, rows in sorted(placed):
        numel = _block_numel(entries[index][1], rows)
        located[(index, start)] = (server, offsets[server])
        offsets[server] += numel

    slices = []
    for index, start, rows in sorted((index, start, rows) for _, index, start, rows in placed):
        name, shape = entries[index][0], entries[index][1]
        server, offset = located[(index, start)]
        block_shape = (rows[1] - rows[0], *shape[1:]) if shape else ()
        slices.append(ShardSlice(name, server, rows, block_shape, offset, _block_numel(shape, rows)))
    return ParameterShardPlan(num_servers, tuple(slices))


def _collect(params: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> list[tuple[str, tuple[int, ...], int]]:
    """Validate the parameters and return ``(name, shape, element_size)`` in the given order."""
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    if not items:
        raise ValueError(
            "The model has no trainable parameters: plan_shards() got 0 parameters, so there is nothing to place on "
            "the parameter servers. Pass model.named_parameters() of a model with at least one parameter."
        )
    entries, seen, duplicates = [], set(), []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"Expected (name, tensor) pairs such as model.named_parameters(), got {item!r}.")
        name, tensor = item
        if not isinstance(tensor, Tensor):
            raise TypeError(f"Parameter {name!r} is a {type(tensor).__name__}, not a torch.Tensor.")
        if not tensor.is_floating_point():
            raise TypeError(
                f"Parameter {name!r} has dtype {tensor.dtype}; only floating-point tensors can live on a parameter "
                f"server. Register it as a buffer (module.register_buffer) or cast it to a floating dtype."
            )
        if name in seen:
            duplicates.append(name)
        seen.add(name)
        entries.append((name, tuple(tensor.shape), tensor.element_size()))
    if duplicates:
        raise ValueError(
            f"Duplicate parameter names {sorted(set(duplicates))}: each piece is addressed by name. Pass "
            f"model.named_parameters() (its names are unique) or rename the duplicates."
        )
    return entries


def _row_blocks(shape: tuple[int, ...], element_size: int, cap: int, min_shard_bytes: int) -> list[tuple[int, int]]:
    """Cut dim 0 into at most ``cap`` nearly equal blocks of at least ``min_shard_bytes``; first blocks larger."""
    if not shape:
        return [(0, 1)]
    rows = shape[0]
    size = math.prod(shape) * element_size
    if rows < 2 or size < 2 * min_shard_bytes:
        return [(0, rows)]
    row_bytes = size // rows
    count = min(cap, rows, size // min_shard_bytes)
    while count > 1 and (rows // count) * row_bytes < min_shard_bytes:
        count -= 1
    base, extra = divmod(rows, count)
    blocks, start = [], 0
    for block in range(count):
        stop = start + base + (1 if block < extra else 0)
        blocks.append((start, stop))
        start = stop
    return blocks


def _block_numel(shape: tuple[int, ...], rows: tuple[int, int]) -> int:
    return (rows[1] - rows[0]) * math.prod(shape[1:]) if shape else 1


def _rows_of(tensor: Tensor, piece: ShardSlice) -> Tensor:
    """The detached view of ``tensor`` that ``piece`` covers, after checking that the tensor fits the plan."""
    start, stop = piece.rows
    if piece.shape == ():
        fits = tensor.dim() == 0
    else:
        fits = tensor.dim() == len(piece.shape) and tuple(tensor.shape[1:]) == piece.shape[1:]
        fits = fits and tensor.shape[0] >= stop
    if not fits:
        raise ValueError(
            f"Tensor {piece.name!r} has shape {tuple(tensor.shape)} but the plan holds rows {piece.rows} of shape "
            f"{piece.shape} for it; the plan was built for another model. Rebuild it with "
            f"plan_shards(model.named_parameters(), num_servers)."
        )
    detached = tensor.detach()
    return detached if piece.shape == () else detached[start:stop]


def _lookup(tensors: Mapping[str, Tensor], name: str) -> Tensor:
    if name not in tensors:
        raise KeyError(f"The plan places parameter {name!r} but the given tensors lack it; pass all of the model's.")
    tensor = tensors[name]
    if not isinstance(tensor, Tensor):
        raise TypeError(
            f"{name!r} maps to {tensor!r}, not a tensor; for gradients, fill missing ones first "
            f"(e.g. torch.zeros_like(param))."
        )
    return tensor


def _check_positive_int(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; {fix}.")
