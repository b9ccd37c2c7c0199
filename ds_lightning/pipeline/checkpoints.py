"""How ``ds_pipeline`` writes and reads checkpoints: every stage's part consolidated by parameter name.

The model's state dict is the union of the stages' (keyed as the unsplit model), and each optimizer's state is keyed
by parameter name across stages and numbered as ``configure_optimizers`` on the whole model would number it
(:mod:`ds_lightning.pipeline.state`), so a checkpoint loads under any stage count, and under a plain Trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning.checkpoint.io import load_into
from ds_lightning.checkpoint.layout import SavedShards
from ds_lightning.checkpoint.strategy_hooks import sharded_parts
from ds_lightning.pipeline import state as pipe_state
from ds_lightning.pipeline.layout import PipelineLayout
from ds_lightning.pipeline.stage import PipelinedModule

if TYPE_CHECKING:
    from ds_lightning.strategies.base import ClusterStrategy as _StrategyBase
else:  # at run time a plain mixin, placed before the strategy's base in its MRO
    _StrategyBase = object

__all__ = ["StageCheckpoints"]


class StageCheckpoints(_StrategyBase):
    """Mixin for ``PipelineStrategy``: consolidated checkpoints of a split model.

    The strategy keeps ``_full`` (the whole pipelined module, kept after teardown), ``_proxy`` (this process's part
    while split), ``_canonical`` (each parameter name to its tied weight's first name), ``_names`` (the names of the
    last split) and ``_full_groups`` (every optimizer's param groups by name over the whole model).
    """

    if TYPE_CHECKING:

        @property
        def layout(self) -> PipelineLayout: ...  # noqa: D102 (declared for the type checker)

    _full: nn.Module | None
    _proxy: PipelinedModule | None
    _canonical: dict[str, str]
    _names: dict[nn.Parameter, str]
    _full_groups: list[list[list[str]]]

    def _names_by_param(self) -> dict[nn.Parameter, str]:
        assert self.lightning_module is not None
        if self._proxy is None:  # after teardown: the names of the last split, which the optimizers still hold
            return self._names
        # A tied weight's copy on a later stage goes by the weight's first name, so its optimizer state merges with it.
        self._names = {p: self._canonical.get(name, name) for name, p in self.lightning_module.named_parameters()}
        return self._names

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        if self.state_dict_type == "sharded":
            return super().lightning_module_state_dict()  # each stage's own tensors, under their unsplit names
        return self.merged_state_dict()

    def merged_state_dict(self) -> dict[str, Any]:
        """Every stage's tensors on every rank, under the unsplit model's keys (collective over the stages)."""
        assert self.lightning_module is not None
        local = self.lightning_module.state_dict()
        if self._full is None or not dist.is_initialized():
            return {k: v.detach().cpu() for k, v in local.items()}
        return pipe_state.merged_state_dict(local, self.world_size, self.layout.pipeline_size)

    def _index(self, optimizer: Optimizer) -> tuple[Optimizer, int]:
        raw = getattr(optimizer, "_optimizer", optimizer)
        return raw, next(i for i, opt in enumerate(self.optimizers) if opt is raw or opt is optimizer)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.state_dict_type == "sharded":
            return super().optimizer_state(optimizer)
        raw, index = self._index(optimizer)
        named = pipe_state.named_cpu_state(raw, self._names_by_param())
        stages = pipe_state.gather_stages(named, self.world_size, self.layout.pipeline_size)
        return pipe_state.consolidate(stages, self._full_groups[index])

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if sharded_parts(checkpoint, "optimizer_states") is not None:
            super().load_optimizer_state_dict(checkpoint)
            return
        names = self._names_by_param()
        for index, (optimizer, full) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"], strict=False)):
            local_groups = pipe_state.group_names(optimizer, names)
            optimizer.load_state_dict(pipe_state.localize(full, self._full_groups[index], local_groups))
            _optimizers_to_device([optimizer], self.root_device)

    # --- sharded: every stage writes and reads its own part with torch.distributed.checkpoint -----------------------

    def sharded_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This stage's state of ``optimizer`` by parameter name, with every stage's names in ``param_groups``.

        ``param_groups`` is the same on every rank (DCP keeps one copy of a key all ranks write), listing the whole
        model's names in the order ``configure_optimizers`` on the unsplit model gives them.
        """
        raw, index = self._index(optimizer)
        named = pipe_state.named_state(raw, self._names_by_param())
        groups = [
            {**hyper, "params": list(full)}
            for hyper, full in zip(named["param_groups"], self._full_groups[index], strict=True)
        ]
        return {"state": named["state"], "param_groups": groups}

    def load_sharded_optimizer_states(self, sources: Sequence[SavedShards]) -> None:
        """Fill each stage optimizer's state in place from the folder (collective over every rank)."""
        if len(sources) != len(self.optimizers):
            raise RuntimeError(
                f"The checkpoint holds {len(sources)} optimizer state(s), but configure_optimizers returned"
                f" {len(self.optimizers)}: resume with the optimizers that wrote it."
            )
        group = self.sharded_checkpoint_group()
        for optimizer, source in zip(self.optimizers, sources, strict=True):
            raw, _ = self._index(optimizer)
            _materialize_state(raw)
            targets = {source.key: self.sharded_optimizer_state(raw)}
            load_into(targets, source.path, group)  # the state tensors are the optimizer's own: filled in place
            for local, saved in zip(raw.param_groups, targets[source.key]["param_groups"], strict=True):
                local.update({k: v for k, v in saved.items() if k != "params"})
        _optimizers_to_device(self.optimizers, self.root_device)


def _materialize_state(optimizer: Optimizer) -> None:
    """Give every parameter its optimizer state tensors, so a load has tensors to fill.

    One step with zero gradients at learning rate 0 creates them without moving a weight (decoupled weight decay is
    scaled by the rate too); the loaded values then replace them, the step count included. A stage's optimizer step
    is local, so this runs no collective.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
