"""Collectives among the live workers: a lost (or finished) worker must not hang the others' barriers and syncs.

The servers know which workers left; when a collective fails, the workers ask them and retry over the survivors.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

log = logging.getLogger(__name__)


class LiveWorkerCollectives:
    """Mixin for a ``DDPStrategy`` subclass: its collectives span the live workers only.

    The strategy provides ``is_server``, ``num_workers``, ``max_updates``, ``timeout_seconds``, ``lightning_module``
    and :meth:`_ask_who_is_gone`, and sets ``_training`` while ``fit`` trains.
    """

    max_updates: int | None
    timeout_seconds: float
    lightning_module: Any
    _training: bool = False

    @property
    def is_server(self) -> bool:
        """Whether this process serves parameters instead of training."""
        raise NotImplementedError

    @property
    def num_workers(self) -> int:
        """Training processes in the run."""
        raise NotImplementedError

    def _ask_who_is_gone(self) -> list[int] | None:
        """The workers the servers saw leave, or ``None`` when there are no servers to ask."""
        raise NotImplementedError

    def _reset_survivors(self) -> None:
        self._gone: set[int] = set()
        self._groups: dict[frozenset[int], Any] = {}

    def _note_gone(self, gone: list[int]) -> None:
        new = set(gone) - self._gone
        if new:
            log.info("ds_parameter_server: worker(s) %s left (finished or lost); collectives go on without them", new)
            self._gone |= new

    def _survivors(self) -> tuple[int, ...]:
        return tuple(w for w in range(self.num_workers) if w not in self._gone)

    def _collective(self, run: Callable[[Any], Any], alone: Callable[[], Any]) -> Any:
        """Run ``run(group)`` over the live workers, learning of lost ones from the servers when it fails."""
        if self.is_server or not (dist.is_available() and dist.is_initialized()):
            return alone()
        for attempt in range(2):
            survivors = self._survivors()
            if len(survivors) == 1:
                return alone()
            if len(survivors) == self.num_workers:
                group = None
            else:
                key = frozenset(survivors)
                if key not in self._groups:
                    self._groups[key] = dist.new_group(
                        list(survivors), timeout=timedelta(seconds=self.timeout_seconds), use_local_synchronization=True
                    )
                group = self._groups[key]
            try:
                return run(group)
            except RuntimeError:
                gone = None if attempt else self._ask_who_is_gone()
                if gone is None:
                    raise
                before = set(self._gone)
                self._note_gone(gone)
                if self._gone == before:
                    raise
        raise AssertionError("unreachable")

    @property
    def _independent(self) -> bool:
        # Under an update budget workers stop at different epochs, so epoch-level collectives cannot pair up.
        return self.max_updates is not None and self._training

    def _refuse_sync(self, what: str) -> None:
        raise RuntimeError(
            f"ds_parameter_server(max_updates={self.max_updates}) cannot {what}: with an update budget the workers"
            " stop at different epochs, so their collectives would not pair up. Log without sync_dist=True, or drop"
            " max_updates and bound the run with max_epochs/max_steps."
        )

    def barrier(self, name: str | None = None) -> None:
        """Wait for the live workers (not at all under an update budget)."""
        if self._independent:
            return  # only the chief writes checkpoints; nobody needs to wait for it
        self._collective(lambda group: dist.barrier(group=group), lambda: None)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's decision across workers; each worker's own under an update budget."""
        if self._independent:
            return decision
        return super().reduce_boolean_decision(decision, all=all)  # type: ignore[misc]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Broadcast ``obj`` from ``src`` to the live workers."""
        if self._independent:
            return obj

        def run(group: Any) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src, group=group)
            return box[0]

        return self._collective(run, lambda: obj)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce ``tensor`` over ``group``, or over the live workers."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is not None:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        if self._independent:
            self._refuse_sync("reduce across workers (self.log(..., sync_dist=True))")
        return self._collective(lambda g: _sync_ddp_if_available(tensor, g, reduce_op=reduce_op), lambda: tensor)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather ``tensor`` from ``group``, or from the live workers."""
        gather = super().all_gather  # type: ignore[misc]
        if group is not None:
            return gather(tensor, group=group, sync_grads=sync_grads)
        if self._independent:
            self._refuse_sync("all_gather across workers")
        return self._collective(lambda g: gather(tensor, group=g, sync_grads=sync_grads), lambda: tensor.unsqueeze(0))

    def _broadcast_module_state(self, module: nn.Module) -> None:
        """Give every live worker rank 0's parameters and buffers (on every worker, with the same tensors)."""
        tensors = [*module.parameters(), *module.buffers()]

        def run(group: Any) -> None:
            with torch.no_grad():
                for tensor in tensors:
                    dist.broadcast(tensor.data, src=0, group=group)

        self._collective(run, lambda: None)

    # --- torchmetrics ---------------------------------------------------------------------------------------------

    def _route_metric_syncs(self) -> None:
        """Route torchmetrics' state gathering, which spans the whole world, through the live workers only.

        Otherwise a metric's ``compute()`` after a worker was lost waits on the lost one and fails the chief.
        """
        assert self.lightning_module is not None
        gather = LiveWorkersGather(self)
        for module in self.lightning_module.modules():
            if isinstance(module, Metric) and module.dist_sync_fn is None and module.process_group is None:
                module.dist_sync_fn = gather  # a user's own sync function or group is left alone

    def _unroute_metric_syncs(self) -> None:
        if self.lightning_module is None:
            return
        for module in self.lightning_module.modules():
            if isinstance(getattr(module, "dist_sync_fn", None), LiveWorkersGather):
                module.dist_sync_fn = None

    def _keep_metrics_local(self) -> None:
        """Under an update budget workers end at different epochs; torchmetrics would all-gather across them."""
        assert self.lightning_module is not None
        synced = [
            name for name, m in self.lightning_module.named_modules() if isinstance(m, Metric) and m.sync_on_compute
        ]
        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.sync_on_compute = False
                module.dist_sync_on_step = False
        if synced:
            rank_zero_info(
                f"ds_parameter_server(max_updates={self.max_updates}): metrics {synced} are computed per worker"
                " (sync_on_compute=False), since workers stop at different epochs; the chief logs its own."
            )


class LiveWorkersGather:
    """A torchmetrics ``dist_sync_fn``: ``gather_all_tensors`` over the strategy's live workers.

    Holds the strategy weakly and pickles to a plain gather, so a model stays picklable and outlives its Trainer.
    """

    def __init__(self, strategy: LiveWorkerCollectives) -> None:
        self._strategy: Callable[[], LiveWorkerCollectives | None] = weakref.ref(strategy)

    def __call__(self, tensor: Tensor, group: Any | None = None) -> list[Tensor]:
        """Gather ``tensor`` from ``group``, or from the live workers."""
        strategy = self._strategy()
        if group is not None or strategy is None:
            return gather_all_tensors(tensor, group=group)
        return strategy._collective(lambda g: gather_all_tensors(tensor, group=g), lambda: [tensor])

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._strategy = lambda: None
