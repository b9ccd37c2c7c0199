"""A worker's training step: pull the newest parameters, compute gradients, push them (averaged over ``push_every``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.optim import Optimizer

from ds_lightning.parameter_server.client import PullResult, ServerClient


class WorkerStep:
    """One worker's pull/push cycle over ``params`` (the module's trainable parameters, updated in place).

    Args:
        client: the worker's connection to every server.
        params: the trainable parameters by name; pulls write into them, pushes read their gradients.
        push_every: average this many steps' gradients before one push.

    """

    def __init__(self, client: ServerClient, params: dict[str, Tensor], push_every: int) -> None:
        self.client = client
        self.params = params
        self.push_every = push_every
        self.pull_due = True
        self.basis = 0
        self.last_pull: PullResult | None = None
        self.budget_spent = False
        self._accumulated: dict[str, Tensor] | None = None
        self._accumulated_steps = 0
        self._logged_bytes = (0, 0)
        self._eval_backup: dict[str, Tensor] | None = None

    def pull(self, trainer: Any, optimizer: Optimizer) -> PullResult:
        """Pull the newest parameters; the optimizer's learning rates become the servers'."""
        result = self.client.pull(self.params, step=trainer.global_step, epoch=trainer.current_epoch)
        self.basis, self.pull_due, self.last_pull = result.version, False, result
        for group, lr in zip(optimizer.param_groups, result.lrs, strict=False):
            group["lr"] = lr  # what LearningRateMonitor shows is the servers' learning rate
        return result

    def push(self, loss: Any, trainer: Any) -> None:
        """Push this step's gradients (or, every ``push_every`` steps, their mean); nothing for a skipped step."""
        if loss is None or self.budget_spent:
            return
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.params.items()}
        if self.push_every > 1:
            if self._accumulated is None:
                self._accumulated = {n: g.detach().clone() for n, g in grads.items()}
            else:
                for name, grad in grads.items():
                    self._accumulated[name] += grad
            self._accumulated_steps += 1
            if self._accumulated_steps < self.push_every:
                return
            grads = {n: g / self._accumulated_steps for n, g in self._accumulated.items()}
            self._accumulated, self._accumulated_steps = None, 0
        self.client.push(grads, basis=self.basis, step=trainer.global_step, epoch=trainer.current_epoch)
        self.pull_due = True

    def peek(self) -> None:
        """Load the servers' newest parameters for validation, keeping the pulled basis to restore after it."""
        self._eval_backup = {n: p.detach().clone() for n, p in self.params.items()}
        self.client.pull(self.params, op="peek")

    def unpeek(self) -> None:
        """Restore the basis after validation: the next gradient is computed on the parameters last pulled."""
        if self._eval_backup is not None:
            with torch.no_grad():
                for name, saved in self._eval_backup.items():
                    self.params[name].copy_(saved)
            self._eval_backup = None

    def log(self, trainer: Any, module: Any) -> None:
        """Log this step's traffic and staleness on the steps Lightning's loggers write (self.log costs ~1 ms)."""
        pushed, pulled = self.client.bytes_pushed, self.client.bytes_pulled
        values = {  # one step's traffic: the previous push and this pull
            "ps/bytes_pushed": float(pushed - self._logged_bytes[0]),
            "ps/bytes_pulled": float(pulled - self._logged_bytes[1]),
        }
        self._logged_bytes = (pushed, pulled)
        every = trainer.log_every_n_steps
        if not every or (trainer.global_step + 1) % every:
            return
        if self.last_pull is not None:
            values["ps/staleness_step_mean"] = self.last_pull.staleness_mean
            values["ps/staleness_step_max"] = self.last_pull.staleness_max
            values["ps/server_updates"] = float(self.last_pull.updates)
            values.update(self.last_pull.stats)
        module.log_dict(values, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)


class PushingOptimizer:
    """Stands in for the worker's optimizer inside Lightning's precision plugin: ``step`` pushes instead of updating."""

    def __init__(self, optimizer: Optimizer, push: Callable[[Any], None]) -> None:
        self._optimizer = optimizer
        self._push = push

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The worker optimizer's param groups (their LRs are the servers')."""
        return self._optimizer.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (if given) and push the gradients instead of updating."""
        if closure is None:
            # The precision plugin ran the closure itself (AMP's scaler does, then steps only on finite gradients).
            self._push(True)
            return None
        loss = closure()
        self._push(loss)  # a closure that returned None (training_step skipped the batch) pushes nothing
        return loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def handle_sigterm_locally(trainer: Any) -> None:
    """Each worker handles its own SIGTERM, without Lightning's per-step broadcast of rank 0's flag.

    Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training step, a per-step collective that would hold
    every worker to the slowest one.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        epoch_loop._broadcast_sigterm_tensor = partial(_raise_on_local_sigterm, trainer)


def _raise_on_local_sigterm(trainer: Any) -> None:
    if getattr(trainer, "received_sigterm", False):
        raise SIGTERMException()
