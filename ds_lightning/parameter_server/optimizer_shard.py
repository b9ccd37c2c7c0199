"""The user's optimizer, rebuilt by a server over its shard, and its state moved between shards and one file.

A server calls ``configure_optimizers`` on its own copy of the model, exactly as a worker would. That optimizer never
steps: it and the user's LR schedulers only hold the hyperparameters. :class:`ShardOptimizer` builds an optimizer of
the same class over the server's pieces of the parameters (row blocks, see
:mod:`ds_lightning.parameter_server.sharding`) and copies the current hyperparameters into it before every step.
That is exact for optimizers whose update is elementwise, which :data:`ELEMENTWISE_OPTIMIZERS` lists; the rest are
refused by :func:`check_server_optimizer`.

Optimizer state leaves a server as tensors with a JSON description (never pickled); it is consolidated into the
single-device ``optimizer.state_dict()`` format, and split again, in :mod:`ds_lightning.parameter_server.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt
from torch import Tensor, nn

from ds_lightning.parameter_server.sharding import ParameterShardPlan

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
_NAMES = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)


def check_trainable_model(trainer: Any) -> None:
    """Refuse a model the servers cannot train, before any process starts.

    Raises:
        ValueError: for no trainable parameters, manual optimization, or an optimizer set-up the servers cannot
            rebuild (also checked again at setup, where ``configure_optimizers`` surely works).

    """
    model = trainer.lightning_module
    if model is None:
        return
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "ds_parameter_server: the model has no trainable parameters, so the servers would have nothing to"
            " hold. Check requires_grad (a frozen backbone needs at least one trainable layer)."
        )
    if not model.automatic_optimization:
        check_server_optimizer([], [], automatic_optimization=False)
    try:
        model.trainer = trainer
        returned = model.configure_optimizers()
    except Exception:  # configure_optimizers may need the data; setup checks again then
        return
    # Lightning's own parser, without its validation: several optimizers must get our message, not Lightning's.
    optimizers, schedulers, monitor = _configure_optimizers(returned)
    configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    check_server_optimizer(optimizers, configs, automatic_optimization=True)


def check_server_optimizer(optimizers: Sequence[Any], schedulers: Sequence[Any], automatic_optimization: bool) -> None:
    """Refuse what the servers cannot run, naming it and the fix.

    Args:
        optimizers: what ``configure_optimizers`` returned, as Lightning parsed it.
        schedulers: Lightning's ``LRSchedulerConfig`` list.
        automatic_optimization: the LightningModule's flag.

    Raises:
        ValueError: for manual optimization, no optimizer or several, an optimizer class outside
            :data:`ELEMENTWISE_OPTIMIZERS` (LBFGS among them: its closure re-runs the model, which only workers
            hold), or a ``ReduceLROnPlateau`` scheduler.

    """
    if not automatic_optimization:
        raise ValueError(
            "ds_parameter_server runs the optimizer on the servers, so it cannot support manual optimization"
            " (self.automatic_optimization = False calls optimizer.step() inside training_step on the worker)."
            " Use automatic optimization, or ds_mirrored for manual optimization."
        )
    if len(optimizers) != 1:
        names = [type(opt).__name__ for opt in optimizers]
        raise ValueError(
            f"ds_parameter_server applies exactly one optimizer on the servers, but configure_optimizers returned"
            f" {len(optimizers)} ({names}). Return one optimizer and use param groups for different settings."
        )
    optimizer = optimizers[0]
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        why = (
            " LBFGS needs a closure that re-evaluates the model, which only a worker can run."
            if isinstance(optimizer, torch.optim.LBFGS)
            else " Servers rebuild the optimizer over row blocks of the parameters, which is exact only when its"
            " update is elementwise."
        )
        raise ValueError(
            f"ds_parameter_server cannot rebuild {type(optimizer).__name__} on its servers.{why} Use one of: {_NAMES}."
        )
    for config in schedulers:
        if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "ds_parameter_server steps LR schedulers on the servers, which never see the monitored metric that"
                " ReduceLROnPlateau needs. Use a step- or epoch-based scheduler (e.g. StepLR, CosineAnnealingLR)."
            )


class ShardOptimizer:
    """One server's parameters (a flat buffer) and an optimizer of the user's class over its pieces.

    Args:
        template: the optimizer ``configure_optimizers`` returned on this server; it supplies the class, the param
            groups and their current hyperparameters.
        named_parameters: the server's model parameters by name (to find each piece's param group).
        plan: the shard plan.
        server: this server's index.

    """

    def __init__(
        self,
        template: torch.optim.Optimizer,
        named_parameters: Mapping[str, Tensor],
        plan: ParameterShardPlan,
        server: int,
    ) -> None:
        self.template = template
        self.plan = plan
        self.server = server
        self.slices = plan.server_slices(server)
        self.flat = torch.zeros(plan.server_numel(server), dtype=torch.float32)
        self.grad = torch.zeros_like(self.flat)
        group_of = {id(p): i for i, group in enumerate(template.param_groups) for p in group["params"]}
        groups: list[list[nn.Parameter]] = [[] for _ in template.param_groups]
        self.params: list[nn.Parameter] = []
        for piece in self.slices:
            param = nn.Parameter(self.flat[piece.offset : piece.offset + piece.numel].view(piece.shape))
            param.grad = self.grad[piece.offset : piece.offset + piece.numel].view(piece.shape)
            self.params.append(param)
            groups[group_of[id(named_parameters[piece.name])]].append(param)
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in template.param_groups]
        template._opt_called = True  # type: ignore[attr-defined]  # it never steps; the schedulers need not warn
        # Every group carries all hyperparameters; the defaults are not passed because some classes (AdamW) store
        # keys there that their constructor does not take.
        build: Callable[..., torch.optim.Optimizer] = type(template)  # the subclass's own constructor, not Optimizer's
        self.optimizer = build([{"params": params, **h} for params, h in zip(groups, hyper, strict=True)])

    def sync_hyperparameters(self) -> None:
        """Copy the template's current hyperparameters (what the LR schedulers set) into the shard optimizer."""
        for mine, theirs in zip(self.optimizer.param_groups, self.template.param_groups, strict=True):
            for key, value in theirs.items():
                if key != "params":
                    mine[key] = value

    def learning_rates(self) -> list[float]:
        """The current learning rate of each param group."""
        return [float(group["lr"]) for group in self.template.param_groups]

    def apply(self, grad: Tensor, lr_factor: float = 1.0) -> None:
        """One optimizer step with ``grad`` (this server's flat gradient), the learning rate scaled by ``lr_factor``."""
        self.sync_hyperparameters()
        self.grad.copy_(grad)
        if lr_factor != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * lr_factor
        self.optimizer.step()

    def export_state(self) -> tuple[list[list[Any]], list[Tensor]]:
        """This shard's optimizer state as ``([[piece index, key], ...], tensors)``."""
        entries: list[list[Any]] = []
        tensors: list[Tensor] = []
        for index, param in enumerate(self.params):
            for key, value in sorted(self.optimizer.state.get(param, {}).items()):
                tensors.append(torch.as_tensor(value).detach().clone())
                entries.append([index, key])
        return entries, tensors

    def import_state(self, entries: Sequence[Sequence[Any]], tensors: Sequence[Tensor]) -> None:
        """Load a state written by :func:`split_full_state` (or :meth:`export_state`)."""
        for (index, key), value in zip(entries, tensors, strict=True):
            param = self.params[int(index)]
            is_piece = value.numel() == param.numel() and value.dim() > 0
            self.optimizer.state[param][str(key)] = value.view(param.shape).clone() if is_piece else value.clone()
