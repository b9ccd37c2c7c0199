"""One ``gradient_compression`` setting attached to one DDP model: the registered method's hook, weighted or two-level.

Every hook logs the tensors it sends in a :class:`~ds_lightning.comm.wire.WireLog`; the method's state is
checkpointable through :meth:`GradientCompressor.state_dict`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ds_lightning.comm.auto import AutoState
from ds_lightning.comm.compression.base import Compression, CompressionOptions
from ds_lightning.comm.compression.registry import create
from ds_lightning.comm.hierarchical import HierarchicalState, HostGroups, hierarchical_hook
from ds_lightning.comm.wire import WireLog

__all__ = ["GradientCompressor"]


class GradientCompressor:
    """One compression setting, attached to one DDP model.

    Args:
        name: a registered method that serves the all-reduce: ``"none"``, ``"fp16"``, ``"bf16"``, ``"powersgd"`` or
            ``"auto"`` (measure the link at set-up and every ``auto_interval`` steps, and run whichever of the
            registry's candidates a cost model predicts fastest; see :mod:`ds_lightning.comm.auto`).
        powersgd_rank: PowerSGD's approximation rank (higher: more accurate, more bytes); under ``"auto"`` the rank
            PowerSGD runs at when chosen (auto never lowers it: it is the accuracy floor).
        powersgd_start_iter: plain all-reduce for this many steps before PowerSGD starts (under ``"auto"``: PowerSGD
            is not chosen before).
        powersgd_min_compression_rate: matrices that would shrink less than this travel uncompressed.
        seed: seed of PowerSGD's initial projections, identical on every rank.
        auto_interval: under ``"auto"``, gradient synchronisations between link probes.

    Raises:
        ValueError: for an unknown ``name``, one that does not serve the all-reduce, or an out-of-range option,
            naming the value and the fix.

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
        options = CompressionOptions(
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
            powersgd_min_compression_rate=powersgd_min_compression_rate,
            seed=seed,
            auto_interval=auto_interval,
        )
        self.method: Compression = create(name, options, use="all_reduce")
        self.name = name
        self._state: Any = None
        self._wire = WireLog()
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
        """Register the method's hook on ``model`` (none for a ``builtin`` method: DDP's own all-reduce is fastest).

        With ``weighted`` every bucket is first multiplied by :attr:`weight`, which the caller sets before each
        backward pass (the load balancer's ``world_size * local_batch / global_batch``), so the mean over ranks
        becomes the mean over the global batch; a hook is then registered for a builtin method too.

        With ``hosts`` (from :func:`~ds_lightning.comm.hierarchical.host_groups`) gradients take the two-level
        all-reduce, and the compression applies to its inter-host stage only; the weighting, if any, comes first.

        Raises:
            RuntimeError: if called twice; DDP accepts one comm hook per model (pytorch issue 102721).
            ValueError: with ``hosts``, for a method that does not serve the two-level all-reduce.

        """
        if self._state is not None:
            raise RuntimeError("GradientCompressor.register was called twice; DDP accepts one comm hook per model.")
        params = [p for p in model.parameters() if p.requires_grad]
        self._uncompressed_bytes = sum(p.numel() * p.element_size() for p in params)
        hook: Callable[[Any, dist.GradBucket], Any]
        if hosts is not None:
            stage = self.method.inter_host(hosts, model, self._wire)
            self._state, hook = HierarchicalState(hosts, wire=self._wire, inter_host=stage), hierarchical_hook
        else:
            self._state, hook = self.method.ddp_hook(process_group, model, self._wire, warmup=True)
        if weighted:
            model.register_comm_hook(self._state, self._weighting(hook))
        elif not self.method.builtin or hosts is not None:
            model.register_comm_hook(self._state, hook)
        self.method.registered()

    @property
    def auto(self) -> AutoState | None:
        """The auto state (choice, decisions, figures) under ``"auto"`` once registered; ``None`` otherwise."""
        return self._state if isinstance(self._state, AutoState) else None

    def _weighting(self, hook: Callable[[Any, dist.GradBucket], Any]) -> Callable[[Any, dist.GradBucket], Any]:
        def weighted(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks a hook's annotations at runtime
            if bucket.is_last():
                # The last bucket is launched once this rank's backward finished: the end of its own compute.
                self.last_bucket_time = time.perf_counter()
            if self.weight != 1.0:
                bucket.buffer().mul_(self.weight)
            return hook(state, bucket)

        return weighted

    @property
    def wire(self) -> WireLog | None:
        """What the hook handed to collectives; ``None`` before :meth:`register` and for a hookless builtin method."""
        if self._state is None or (self.method.builtin and self._wire.steps == 0):
            return None
        return self._wire

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
        return {"name": self.name, **self.method.state_dict()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict`'s output, moving tensors to ``device``.

        Raises:
            ValueError: if ``state`` was saved under another compression setting.

        """
        if state.get("name") != self.name:
            raise ValueError(f"compression state was saved for {state.get('name')!r}, not {self.name!r}.")
        self.method.load_state_dict({k: v for k, v in state.items() if k != "name"}, device=device)
