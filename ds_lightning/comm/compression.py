"""Gradient compression as DDP communication hooks, shared by every strategy that all-reduces gradients.

``fp16``/``bf16`` use torch's own hooks; ``powersgd`` uses :mod:`ds_lightning.comm.powersgd` (gloo-safe, with
per-parameter state that survives DDP's bucket rebuild). Every hook logs the tensors it sends in a
:class:`~ds_lightning.comm.wire.WireLog`; this module also keeps a checkpointable state.
"""

# No `from __future__ import annotations`: DDP checks the hooks' annotations at runtime.

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ds_lightning import _validation as check
from ds_lightning.comm.auto import AutoState, Workload, auto_hook
from ds_lightning.comm.auto.model import powersgd_numel
from ds_lightning.comm.hierarchical import HierarchicalState, HostGroups, hierarchical_hook
from ds_lightning.comm.powersgd import PowerSGDState, powersgd_hook
from ds_lightning.comm.wire import WireLog

__all__ = ["COMPRESSIONS", "CompressionName", "GradientCompressor"]

CompressionName = Literal["none", "fp16", "bf16", "powersgd", "auto"]
COMPRESSIONS: tuple[str, ...] = get_args(CompressionName)


@dataclass
class _CastState:
    """State of the plain and half-width hooks: the group plus what was sent."""

    process_group: dist.ProcessGroup | None
    wire: WireLog = field(default_factory=WireLog)


def _logged_allreduce_hook(state: _CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # torch's allreduce_hook all-reduces bucket.buffer() itself: the tensor counted here is the one sent.
    state.wire.record(bucket.buffer())
    if bucket.is_last():
        state.wire.end_step()
    return default_hooks.allreduce_hook(state.process_group, bucket)  # type: ignore[arg-type]


# torch's wrappers cast the bucket's buffer, then hand the cast bucket to the inner hook: the log sees the cast tensor.
_fp16_allreduce = default_hooks.fp16_compress_wrapper(_logged_allreduce_hook)
_bf16_allreduce = default_hooks.bf16_compress_wrapper(_logged_allreduce_hook)


def _allreduce_hook(state: _CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _logged_allreduce_hook(state, bucket)


def _fp16_hook(state: _CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _fp16_allreduce(state, bucket)


def _bf16_hook(state: _CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _bf16_allreduce(state, bucket)


def _powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return powersgd_hook(state, bucket)


class GradientCompressor:
    """One compression setting, attached to one DDP model.

    Args:
        name: ``"none"``, ``"fp16"``, ``"bf16"``, ``"powersgd"`` or ``"auto"`` (measure the link at set-up and every
            ``auto_interval`` steps, and run whichever of ``none``, ``fp16`` and ``powersgd`` a cost model predicts
            fastest; see :mod:`ds_lightning.comm.auto`).
        powersgd_rank: PowerSGD's approximation rank (higher: more accurate, more bytes); under ``"auto"`` the rank
            PowerSGD runs at when chosen (auto never lowers it: it is the accuracy floor).
        powersgd_start_iter: plain all-reduce for this many steps before PowerSGD starts (under ``"auto"``: PowerSGD
            is not chosen before).
        powersgd_min_compression_rate: matrices that would shrink less than this travel uncompressed.
        seed: seed of PowerSGD's initial projections, identical on every rank.
        auto_interval: under ``"auto"``, gradient synchronisations between link probes.

    Raises:
        ValueError: for an unknown ``name`` or out-of-range option, naming the value and the fix.

    """

    def __init__(
        self,
        name: str = "none",
        powersgd_rank: int = 2,
        powersgd_start_iter: int = 10,
        powersgd_min_compression_rate: float = 2.0,
        seed: int = 0,
        auto_interval: int = 500,
    ) -> None:
        check.choice("gradient_compression", name, COMPRESSIONS)
        check.integer("powersgd_rank", powersgd_rank, 1, "powersgd_rank=2")
        check.integer("powersgd_start_iter", powersgd_start_iter, 0, "powersgd_start_iter=10")
        check.number("powersgd_min_compression_rate", powersgd_min_compression_rate, "2.0", above=0)
        check.integer("auto_interval", auto_interval, 1, "auto_interval=500", "steps between link probes")
        self.name = name
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.powersgd_min_compression_rate = powersgd_min_compression_rate
        self.seed = seed
        self.auto_interval = auto_interval
        self._state: _CastState | PowerSGDState | AutoState | None = None
        self._uncompressed_bytes = 0
        self.weight = 1.0  # applied to every bucket when registered with weighted=True
        self.last_bucket_time = 0.0  # perf_counter() when the last bucket's hook last started (weighted only)

    def register(
        self,
        model: DistributedDataParallel,
        process_group: dist.ProcessGroup | None = None,
        weighted: bool = False,
        hosts: HostGroups | None = None,
    ) -> None:
        """Register the hook on ``model`` (none for ``"none"``: DDP's built-in all-reduce is fastest).

        With ``weighted`` every bucket is first multiplied by :attr:`weight`, which the caller sets before each
        backward pass (the load balancer's ``world_size * local_batch / global_batch``), so the mean over ranks
        becomes the mean over the global batch; a hook is then registered for ``"none"`` too.

        With ``hosts`` (from :func:`~ds_lightning.comm.hierarchical.host_groups`) gradients take the two-level
        all-reduce, and the compression applies to its inter-host stage only; the weighting, if any, comes first.

        Raises:
            RuntimeError: if called twice; DDP accepts one comm hook per model (pytorch issue 102721).

        """
        if self._state is not None:
            raise RuntimeError("GradientCompressor.register was called twice; DDP accepts one comm hook per model.")
        params = [p for p in model.parameters() if p.requires_grad]
        self._uncompressed_bytes = sum(p.numel() * p.element_size() for p in params)
        hook: Callable[[Any, dist.GradBucket], Any]
        if self.name == "auto":
            if hosts is not None:
                raise ValueError(
                    "gradient_compression='auto' does not yet drive the two-level all-reduce: set hierarchical=False"
                    " (flat all-reduce, chosen compression) or pick a fixed gradient_compression."
                )
            self._state = hook_state = self._auto_state(model, process_group)
            hook = auto_hook
        elif self.name == "powersgd":
            state = PowerSGDState(
                process_group=hosts.leaders if hosts is not None else process_group,
                rank=self.powersgd_rank,
                start_iter=self.powersgd_start_iter,
                min_compression_rate=self.powersgd_min_compression_rate,
                seed=self.seed,
                param_index={id(p): i for i, p in enumerate(model.parameters())},
            )
            self._state, hook_state, hook = state, state, _powersgd_hook
        else:
            self._state = hook_state = _CastState(process_group=process_group)
            hook = {"none": _allreduce_hook, "fp16": _fp16_hook, "bf16": _bf16_hook}[self.name]
        if hosts is not None:
            hook_state = HierarchicalState(
                hosts,
                wire=self._state.wire,
                cast={"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.name),
                powersgd=self._state if isinstance(self._state, PowerSGDState) else None,
            )
            hook = hierarchical_hook
        if weighted:
            model.register_comm_hook(hook_state, self._weighting(hook))
        elif self.name != "none" or hosts is not None:
            model.register_comm_hook(hook_state, hook)
        if isinstance(self._state, AutoState):
            self._state.decide(probe=True)  # at set-up, on every rank: the probe and the broadcast are collectives

    def _auto_state(self, model: DistributedDataParallel, process_group: dist.ProcessGroup | None) -> AutoState:
        params = [p for p in model.parameters() if p.requires_grad]
        shapes = [tuple(p.shape) for p in params]
        powersgd = PowerSGDState(
            process_group=process_group,
            rank=self.powersgd_rank,
            start_iter=0,  # the auto state keeps PowerSGD off until powersgd_start_iter
            min_compression_rate=self.powersgd_min_compression_rate,
            seed=self.seed,
            param_index={id(p): i for i, p in enumerate(model.parameters())},
        )
        cast = _CastState(process_group=process_group, wire=powersgd.wire)  # one wire log for every choice
        matrices = []
        for shape in shapes:
            if len(shape) >= 2 and shape[0] > 0:
                n, m = shape[0], int(torch.Size(shape).numel()) // shape[0]
                r = min(n, m, self.powersgd_rank)
                if (n + m) * r * self.powersgd_min_compression_rate < n * m:
                    matrices.append((n, m, r))
        numel = powersgd_numel(shapes, self.powersgd_rank, self.powersgd_min_compression_rate)
        device = params[0].device if params else torch.device("cpu")
        return AutoState(
            process_group=process_group,
            device=device,
            hooks={"none": (cast, _allreduce_hook), "fp16": (cast, _fp16_hook), "powersgd": (powersgd, _powersgd_hook)},
            powersgd=powersgd,
            workload=Workload(self._uncompressed_bytes, numel * 4, buckets=1),
            compute_matrices=matrices,
            interval=self.auto_interval,
            start_iter=self.powersgd_start_iter,
        )

    @property
    def auto(self) -> AutoState | None:
        """The auto state (choice, decisions, figures) under ``"auto"`` once registered; ``None`` otherwise."""
        return self._state if isinstance(self._state, AutoState) else None

    def _weighting(self, hook: Callable[[Any, dist.GradBucket], Any]) -> Callable[[Any, dist.GradBucket], Any]:
        def weighted(state, bucket):  # unannotated: DDP checks a hook's annotations at runtime
            if bucket.is_last():
                # The last bucket is launched once this rank's backward finished: the end of its own compute.
                self.last_bucket_time = time.perf_counter()
            if self.weight != 1.0:
                bucket.buffer().mul_(self.weight)
            return hook(state, bucket)

        return weighted

    @property
    def wire(self) -> WireLog | None:
        """What the hook handed to collectives; ``None`` before :meth:`register` and for hookless ``"none"``."""
        if self._state is None or (self.name == "none" and self._state.wire.steps == 0):
            return None
        return self._state.wire

    @property
    def bytes_per_step(self) -> float:
        """Mean payload bytes this rank handed to gradient collectives per optimizer step, as measured by the hook.

        ``"none"`` without a hook (DDP's built-in all-reduce, kept hook-free for speed) reports the gradient bytes
        of the parameters DDP reduces: its buckets hold exactly those, and every bucket is all-reduced each step.
        Under the two-level all-reduce it counts the inter-host stage only: a leader's payload, 0 on other ranks.
        """
        wire = self.wire
        if wire is not None:
            return wire.bytes_per_step
        return float(self._uncompressed_bytes) if self._state is not None else 0.0

    @property
    def rounds(self) -> int | None:
        """Gradient synchronisations so far, counted by the hook (``None`` for ``"none"``, which has no hook)."""
        wire = self.wire
        return wire.steps if wire is not None else None

    @property
    def uncompressed_bytes_per_step(self) -> int:
        """Bytes one uncompressed gradient all-reduce carries."""
        return self._uncompressed_bytes

    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state, as tensors and plain numbers (loadable with ``weights_only=True``)."""
        out: dict[str, Any] = {"name": self.name}
        if isinstance(self._state, (PowerSGDState, AutoState)):
            out.update(self._state.state_dict())
        return out

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict`'s output, moving tensors to ``device``.

        Raises:
            ValueError: if ``state`` was saved under another compression setting.

        """
        if state.get("name") != self.name:
            raise ValueError(f"compression state was saved for {state.get('name')!r}, not {self.name!r}.")
        if isinstance(self._state, (PowerSGDState, AutoState)):
            self._state.load_state_dict(state, device=device)
