"""How ``ds_pipeline`` writes and reads checkpoints: every stage's part consolidated by parameter name.

The model's state dict is the union of the stages' (keyed as the unsplit model), and each optimizer's state is keyed
by parameter name across stages and numbered as ``configure_optimizers`` on the whole model would number it
(:mod:`ds_lightning.pipeline.state`), so a checkpoint loads under any stage count, and under a plain Trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning.pipeline import state as pipe_state
from ds_lightning.pipeline.layout import PipelineLayout
from ds_lightning.pipeline.stage import PipelinedModule

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _StrategyBase
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
        local = self.lightning_module.state_dict()
        if self._full is None or not dist.is_initialized():
            return {k: v.detach().cpu() for k, v in local.items()}
        return pipe_state.merged_state_dict(local, self.world_size, self.layout.pipeline_size)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        raw = getattr(optimizer, "_optimizer", optimizer)
        index = next(i for i, opt in enumerate(self.optimizers) if opt is raw or opt is optimizer)
        named = pipe_state.named_cpu_state(raw, self._names_by_param())
        stages = pipe_state.gather_stages(named, self.world_size, self.layout.pipeline_size)
        return pipe_state.consolidate(stages, self._full_groups[index])

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        names = self._names_by_param()
        for index, (optimizer, full) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"], strict=False)):
            local_groups = pipe_state.group_names(optimizer, names)
            optimizer.load_state_dict(pipe_state.localize(full, self._full_groups[index], local_groups))
            _optimizers_to_device([optimizer], self.root_device)
