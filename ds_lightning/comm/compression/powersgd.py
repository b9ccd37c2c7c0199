"""``gradient_compression="powersgd"``: PowerSGD (Vogels et al., 2019), its state keyed by parameter.

It runs as a DDP comm hook and as the inter-host stage of the two-level all-reduce.

Why not torch's ``powerSGD_hook``:

* it issues its second all-reduce from a future callback, which runs on a backend worker thread; with several DDP
  buckets in flight the ranks then issue collectives in different orders, and gloo pairs mismatched messages
  ("Received data size doesn't match expected size") as soon as a model spans more than one bucket;
* its error-feedback and warm-start memories are keyed by bucket index and laid out in bucket order, and DDP rebuilds
  its buckets after the first iteration of every run, so a restored state lands on the wrong entries after a resume.

Here every collective is issued from the hook's own thread, in bucket order, and the state lives per parameter.
PowerSGD needs every rank's gradient at once (its factors are all-reduced), so it does not compress
parameter-server pushes.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ds_lightning.comm.compression.base import Compression, Hook
from ds_lightning.comm.compression.registry import register
from ds_lightning.comm.hierarchical import HostGroups
from ds_lightning.comm.wire import WireLog

__all__ = ["PowerSGD", "PowerSGDStage", "PowerSGDState", "powersgd_hook"]


@dataclass
class PowerSGDState:
    """Configuration and per-parameter memory of PowerSGD on one rank.

    Attributes:
        process_group: group to all-reduce over (``None``: the default group).
        rank: approximation rank ``r``: a ``n x m`` gradient travels as ``(n + m) * r`` numbers.
        start_iter: plain all-reduce for this many steps first (compression early in training hurts accuracy).
        min_compression_rate: matrices that would shrink less than this travel uncompressed.
        seed: seed of the initial random ``Q`` of each parameter; identical on every rank.
        param_index: ``id(param)`` to the parameter's position in the model, the key of all memories.
        iter: optimizer steps seen (counted at each step's last bucket).
        error: local compression error per parameter, added back next step (error feedback).
        q_memory: last ``Q`` per parameter, reused as the next step's starting point (warm start).
        wire: what this rank's collectives sent, per step.

    """

    process_group: dist.ProcessGroup | None = None
    rank: int = 2
    start_iter: int = 10
    min_compression_rate: float = 2.0
    seed: int = 0
    param_index: dict[int, int] = field(default_factory=dict)
    iter: int = 0
    error: dict[int, Tensor] = field(default_factory=dict)
    q_memory: dict[int, Tensor] = field(default_factory=dict)
    wire: WireLog = field(default_factory=WireLog)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain numbers only, so ``torch.load(..., weights_only=True)`` reads it."""
        return {
            "iter": self.iter,
            "error": {k: v.detach().cpu().clone() for k, v in self.error.items()},
            "q_memory": {k: v.detach().cpu().clone() for k, v in self.q_memory.items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict`'s output, moving tensors to ``device``."""
        self.iter = int(state["iter"])
        # A sharded checkpoint writes no empty dict (DCP stores leaves) and string keys: absent means none yet.
        self.error = {int(k): v.to(device) for k, v in state.get("error", {}).items()}
        self.q_memory = {int(k): v.to(device) for k, v in state.get("q_memory", {}).items()}


def _bucket_views(bucket: dist.GradBucket) -> list[tuple[Tensor, Tensor]]:
    """``(param, grad view into the flat bucket buffer)`` in bucket order."""
    buffer = bucket.buffer()
    views, offset = [], 0
    for param in bucket.parameters():
        views.append((param, buffer[offset : offset + param.numel()].view_as(param)))
        offset += param.numel()
    if offset != buffer.numel():
        raise RuntimeError(
            f"DDP bucket layout has {buffer.numel()} elements, its parameters {offset}; cannot compress."
        )
    return views


def _worth_compressing(n: int, m: int, rank: int, min_rate: float) -> bool:
    return (n + m) * rank * min_rate < n * m


def _orthonormalise(matrix: Tensor) -> Tensor:
    # Reduced QR: columns become an orthonormal basis of the same span.
    return torch.linalg.qr(matrix, mode="reduced").Q if matrix.shape[1] > 0 else matrix


def _initial_q(state: PowerSGDState, index: int, m: int, r: int, like: Tensor) -> Tensor:
    generator = torch.Generator().manual_seed(state.seed * 1_000_003 + index)
    return torch.randn(m, r, generator=generator, dtype=like.dtype).to(like.device)


def _all_reduce_sum(state: PowerSGDState, tensor: Tensor) -> None:
    state.wire.record(tensor)
    # Synchronous on purpose: issuing every collective from this thread keeps the order identical on all ranks.
    dist.all_reduce(tensor, group=state.process_group)


def _completed(tensor: Tensor) -> torch.futures.Future[Tensor]:
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket's gradients, rank-``r`` compressed per matrix after ``start_iter`` steps."""
    _average_bucket(state, bucket)
    if bucket.is_last():
        state.iter += 1
        state.wire.end_step()
    return _completed(bucket.buffer())


@dataclass
class PowerSGDStage:
    """The leaders' stage of the two-level all-reduce: PowerSGD over the leaders' group, on the hosts' sums.

    The two-level hook closes the wire log's step itself, so this stage only counts PowerSGD's iterations.
    """

    state: PowerSGDState

    def __call__(self, bucket: dist.GradBucket, groups: HostGroups) -> None:
        """Average the bucket's host sums over the leaders, then scale to the mean over every rank."""
        _average_bucket(self.state, bucket)  # the mean over leaders of the host sums
        if bucket.is_last():
            self.state.iter += 1
        bucket.buffer().mul_(len(groups.layout.hosts) / groups.layout.world_size)


def _average_bucket(state: PowerSGDState, bucket: dist.GradBucket) -> None:
    """Replace the bucket's gradients by their (approximate) mean over the group, in place."""
    world = dist.get_world_size(state.process_group)
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        buffer.div_(world)
        _all_reduce_sum(state, buffer)
        return

    plain: list[Tensor] = []
    matrices: list[tuple[int, Tensor, Tensor]] = []  # (param index, grad view, n x m matrix with error added)
    for param, grad in _bucket_views(bucket):
        index = state.param_index[id(param)]
        if grad.dim() < 2:
            plain.append(grad)
            continue
        n = grad.shape[0]
        m = grad.numel() // n
        r = min(n, m, state.rank)
        if not _worth_compressing(n, m, r, state.min_compression_rate):
            plain.append(grad)
            continue
        # A fresh tensor: the gradient view is overwritten with the result, and this one becomes the new error.
        error = state.error.get(index)
        matrix = grad.reshape(n, m) + error if error is not None else grad.reshape(n, m).clone()
        matrices.append((index, grad, matrix))

    # Phase 1: P = M Q for every matrix, sent in one all-reduce together with the uncompressed gradients.
    ps, qs = [], []
    for index, _, matrix in matrices:
        r = min(matrix.shape[0], matrix.shape[1], state.rank)
        q = state.q_memory.get(index)
        if q is None or q.shape != (matrix.shape[1], r):
            q = _initial_q(state, index, matrix.shape[1], r, matrix)
        q = _orthonormalise(q)
        qs.append(q)
        ps.append(matrix @ q)
    phase1 = torch.cat([t.reshape(-1) for t in plain] + [p.reshape(-1) for p in ps]) if plain or ps else buffer[:0]
    _all_reduce_sum(state, phase1)
    offset = 0
    for t in plain:
        t.copy_(phase1[offset : offset + t.numel()].view_as(t)).div_(world)
        offset += t.numel()
    for i, p in enumerate(ps):
        ps[i] = _orthonormalise(phase1[offset : offset + p.numel()].view_as(p))
        offset += p.numel()

    # Phase 2: Q = M^T P, all-reduced; the mean gradient is approximated by P Q^T / world.
    new_qs = [matrix.t() @ p for (_, _, matrix), p in zip(matrices, ps, strict=True)]
    if new_qs:
        phase2 = torch.cat([q.reshape(-1) for q in new_qs])
        _all_reduce_sum(state, phase2)
        offset = 0
        for (index, grad, matrix), p, q in zip(matrices, ps, new_qs, strict=True):
            q_sum = phase2[offset : offset + q.numel()].view_as(q)
            offset += q.numel()
            state.q_memory[index] = q_sum.clone()
            # Mean gradient ~ P Q^T / world, written straight into the bucket; the scale goes on the small factor.
            approx = grad.view(matrix.shape)
            torch.mm(p, q_sum.t().div(world), out=approx)
            state.error[index] = matrix.sub_(approx)  # reuse the matrix's memory for the new local error


def _matrix(shape: tuple[int, ...], rank: int, min_rate: float) -> tuple[int, int, int] | None:
    """``(n, m, r)`` of a parameter PowerSGD compresses as an ``n x m`` matrix at rank ``r``, else ``None``."""
    if len(shape) < 2 or shape[0] == 0:
        return None
    n = shape[0]
    m = int(torch.Size(shape).numel()) // n
    r = min(n, m, rank)
    return (n, m, r) if _worth_compressing(n, m, r, min_rate) else None


@register
class PowerSGD(Compression):
    """Rank-``powersgd_rank`` PowerSGD with error feedback and warm start, after ``powersgd_start_iter`` plain steps."""

    name = "powersgd"
    uses = frozenset({"all_reduce", "two_level"})
    unsupported = {
        "push": "its low-rank factors are all-reduced, so it needs every worker's gradient at once, and a push"
        " carries one worker's"
    }
    auto_candidate = True
    checkpointed = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state: PowerSGDState | None = None

    def _state(
        self, group: dist.ProcessGroup | None, model: DistributedDataParallel, wire: WireLog, warmup: bool
    ) -> PowerSGDState:
        options = self.options
        self.state = PowerSGDState(
            process_group=group,
            rank=options.powersgd_rank,
            start_iter=options.powersgd_start_iter if warmup else 0,
            min_compression_rate=options.powersgd_min_compression_rate,
            seed=options.seed,
            param_index={id(p): i for i, p in enumerate(model.parameters())},
            wire=wire,
        )
        return self.state

    @override
    def ddp_hook(
        self, process_group: dist.ProcessGroup | None, model: DistributedDataParallel, wire: WireLog, warmup: bool
    ) -> tuple[Any, Hook]:
        return self._state(process_group, model, wire, warmup), powersgd_hook

    @override
    def inter_host(self, hosts: HostGroups, model: DistributedDataParallel, wire: WireLog) -> PowerSGDStage:
        return PowerSGDStage(self._state(hosts.leaders, model, wire, warmup=True))

    @override
    def chosen(self) -> None:
        if self.state is not None:
            # The memory holds the residual of gradients from the last time PowerSGD ran, possibly many steps and a
            # different model ago: adding it to today's gradient would apply an old update a second time.
            self.state.error.clear()

    @override
    @property
    def warmup_steps(self) -> int:
        return self.options.powersgd_start_iter

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict() if self.state is not None else {}

    @override
    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        if self.state is not None:
            self.state.load_state_dict(state, device=device)

    @override
    def sent_bytes(self, shapes: Sequence[tuple[int, ...]]) -> float:
        """float32 numbers sent per step: ``(n + m) * r`` per compressed matrix, every entry of the rest."""
        options, total = self.options, 0
        for shape in shapes:
            matrix = _matrix(shape, options.powersgd_rank, options.powersgd_min_compression_rate)
            total += (matrix[0] + matrix[1]) * matrix[2] if matrix else int(torch.Size(shape).numel())
        return 4.0 * total

    @override
    @classmethod
    def comm_seconds(cls, link: Any, work: Any) -> float:
        """Two all-reduces per bucket (``P``, then ``Q``) of the factors, plus the products and QRs."""
        sent = link.float32.seconds(work.sent_bytes[cls.name], link.world_size, 2 * work.buckets)
        return sent + link.compress_s.get(cls.name, 0.0)

    @override
    def compute_probe(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> Callable[[], object] | None:
        options = self.options
        matrices = [
            m for s in shapes if (m := _matrix(s, options.powersgd_rank, options.powersgd_min_compression_rate))
        ]
        if not matrices:
            return None
        generator = torch.Generator().manual_seed(0)
        mats = [(torch.randn(n, m, generator=generator).to(device), r) for n, m, r in matrices]

        def products() -> None:  # the same products and QRs as the hook, per matrix
            for matrix, r in mats:
                q = torch.linalg.qr(matrix[:r].t().contiguous(), mode="reduced").Q
                p = torch.linalg.qr(matrix @ q, mode="reduced").Q
                q = matrix.t() @ p
                torch.sub(matrix, p @ q.t())  # the new error

        return products
