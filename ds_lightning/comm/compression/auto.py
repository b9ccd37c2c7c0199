"""``gradient_compression="auto"``: measure the link, run whichever registered candidate is predicted fastest.

The machinery (probe, cost model, dispatching hook) is :mod:`ds_lightning.comm.auto`; this module makes it a method
of the registry. Its candidates are the registry's ``auto_candidate`` methods, each with the user's options (PowerSGD
at the user's rank), built when the hook is: a method registered later is a candidate too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from ds_lightning.comm.auto import AutoState, Workload, auto_hook
from ds_lightning.comm.compression.base import Compression, Hook
from ds_lightning.comm.compression.registry import auto_candidates, register

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ds_lightning.comm.wire import WireLog

__all__ = ["Auto"]


@register
class Auto(Compression):
    """Probe at set-up and every ``auto_interval`` steps; run the candidate a cost model predicts fastest."""

    name = "auto"
    uses = frozenset({"all_reduce"})
    unsupported = {
        "two_level": "it does not yet drive it; hierarchical='auto' runs auto flat",
        "push": "it chooses among all-reduce hooks",
    }
    checkpointed = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.auto: AutoState | None = None

    @override
    def ddp_hook(
        self, process_group: dist.ProcessGroup | None, model: DistributedDataParallel, wire: WireLog, warmup: bool
    ) -> tuple[Any, Hook]:
        params = [p for p in model.parameters() if p.requires_grad]
        shapes = [tuple(p.shape) for p in params]
        candidates = tuple(method(self.options) for method in auto_candidates())
        # Every candidate's own warm-up is off: the auto state keeps each out until its warmup_steps.
        hooks = {c.name: c.ddp_hook(process_group, model, wire, warmup=False) for c in candidates}
        gradient_bytes = sum(p.numel() * p.element_size() for p in params)
        self.auto = AutoState(
            process_group=process_group,
            device=params[0].device if params else torch.device("cpu"),
            candidates=candidates,
            hooks=hooks,
            wire=wire,
            workload=Workload(gradient_bytes, {c.name: c.sent_bytes(shapes) for c in candidates}, buckets=1),
            shapes=shapes,
            interval=self.options.auto_interval,
        )
        return self.auto, auto_hook

    @override
    def registered(self) -> None:
        assert self.auto is not None
        self.auto.decide(probe=True)  # at set-up, on every rank: the probe and the broadcast are collectives

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.auto.state_dict() if self.auto is not None else {}

    @override
    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        if self.auto is not None:
            self.auto.load_state_dict(state, device=device)
