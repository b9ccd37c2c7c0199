"""How ``ds_pipeline`` sets up a traced split: sample, cut, trace, and this process's stages, runtime and proxy."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ds_lightning.pipeline import split
from ds_lightning.pipeline.graph_split import auto_split_points, canonical_names, trace_split
from ds_lightning.pipeline.layout import PipelineLayout
from ds_lightning.pipeline.mesh import PipelineGroups
from ds_lightning.pipeline.runtime import PipelineRuntime
from ds_lightning.pipeline.schedules import ScheduleSpec
from ds_lightning.pipeline.stage import GraphStage, PipelinedModule

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _StrategyBase
else:  # at run time a plain mixin, placed before the strategy's base in its MRO
    _StrategyBase = object

__all__ = ["TracedSplitting"]


class TracedSplitting(_StrategyBase):
    """Mixin for ``PipelineStrategy``: split a module that is not an ``nn.Sequential`` with torch's tracer.

    The strategy provides its options (``pipe_module``, ``split_points``, ``balance``, ``n_microbatches``,
    ``activation_checkpointing``), its layout and groups, and keeps what the split makes.
    """

    pipe_module: str
    split_points: list[str] | Literal["auto"] | None
    balance: list[int] | Literal["auto"] | None
    balance_used: list[int] | None
    n_microbatches: int
    activation_checkpointing: bool
    schedule: str
    _spec: ScheduleSpec
    _groups: PipelineGroups | None
    _canonical: dict[str, str]
    _param_names: list[str]
    _full: nn.Module | None
    _runtime: PipelineRuntime | None
    _proxy: PipelinedModule | None

    if TYPE_CHECKING:

        @property
        def layout(self) -> PipelineLayout: ...  # noqa: D102 (declared for the type checker)

        @property
        def pipeline_rank(self) -> int: ...  # noqa: D102 (declared for the type checker)

        def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def _split_traced(self, trainer: Trainer, module: LightningModule, net: nn.Module, fitting: bool) -> None:
        if self._spec.style == "v":
            # torch 2.13's graph stages send between the two stages a V puts on one process over the network, to
            # the process itself, which gloo refuses ("Pair is not connected"); layer-list stages do not.
            raise ValueError(
                f"schedule={self.schedule!r} places two stages of a V on each process, which torch 2.13's traced "
                "stages cannot run; use schedule='1F1B', 'Interleaved1F1B' or 'InterleavedZeroBubble' with a traced "
                "module, or make the model an nn.Sequential."
            )
        setattr(module, self.pipe_module, net)
        split.check_contract(module, self.pipe_module, fitting)
        self._canonical = canonical_names(module)
        self._param_names, self._full = [name for name, _ in module.named_parameters()], net
        net.to(self.root_device)  # traced where it runs: ops that make tensors record their device
        sample = split.sample_batch_input(trainer, module, "give the training batches first (fit)")
        args, kwargs = move_data_to_device(
            split.first_microbatch(*split.as_call(sample), self.n_microbatches), self.root_device
        )
        cuts = self.split_points
        if not isinstance(cuts, list):
            run = lambda: net(*args, **kwargs)  # noqa: E731
            cuts, self.balance_used = auto_split_points(net, self.layout.stages, self.balance, run, self._average_costs)
            rank_zero_info(f"ds_pipeline: split_points='auto' cuts before {cuts} ({self.balance_used} per stage)")
        stage_ids = self.layout.stage_indices(self.pipeline_rank, self._spec.style)
        traced = trace_split(net, args, kwargs, cuts, stage_ids)
        if fitting:
            traced.check_every_rank_trains(self.layout, self._spec.style)
        groups = self._groups
        assert groups is not None
        make_stage = partial(
            GraphStage.build, traced.pipe_info, self.root_device, groups.pipeline, self.activation_checkpointing
        )
        self._runtime = PipelineRuntime(
            traced.stage_modules,
            self.layout,
            self._spec,
            self.n_microbatches,
            groups,
            self.root_device,
            self._scaled_loss,
            make_stage=make_stage,
            microbatch_rows=traced.microbatch_rows,
            tied=traced.tied_weights(net),
        )
        self._proxy = PipelinedModule({}, self._runtime.evaluate, traced.local_parameters)
        setattr(module, self.pipe_module, self._proxy)

    def _average_costs(self, costs: list[float]) -> list[float]:
        # Timings differ per process; averaging them makes every rank choose the same split.
        summed = torch.tensor(costs, dtype=torch.float64, device=self.root_device)
        dist.all_reduce(summed)
        return (summed / self.world_size).tolist()
