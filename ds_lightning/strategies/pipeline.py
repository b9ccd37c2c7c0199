"""``ds_pipeline``: pipeline model parallelism on ``torch.distributed.pipelining``, optionally x data parallelism.

The strategy fits the pipeline into Lightning's loop; the pipeline itself (split and balance, layout and process
groups, schedules, the runtime that runs them, micro-batching, checkpoint consolidation, trace) lives in
:mod:`ds_lightning.pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.checkpoint.options import StateDictType
from ds_lightning.pipeline import microbatch, split
from ds_lightning.pipeline import state as pipe_state
from ds_lightning.pipeline.checkpoints import StageCheckpoints
from ds_lightning.pipeline.clipping import GlobalNormPrecision, check_pipeline_precision
from ds_lightning.pipeline.compiled import compile_stages
from ds_lightning.pipeline.graph_split import check_split_points
from ds_lightning.pipeline.layout import PipelineLayout
from ds_lightning.pipeline.mesh import PipelineGroups, build_groups
from ds_lightning.pipeline.partition import check_balance, resolve_balance, stage_layer_ranges
from ds_lightning.pipeline.profile import auto_balance
from ds_lightning.pipeline.runtime import PipelineRuntime, write_trace
from ds_lightning.pipeline.schedules import (
    ScheduleName,
    canonical_name,
    check_microbatches,
    resolve_stages_per_rank,
    schedule_spec,
)
from ds_lightning.pipeline.stage import PipelinedModule, StageModule
from ds_lightning.pipeline.trace import SpanRecorder
from ds_lightning.pipeline.traced_setup import TracedSplitting
from ds_lightning.strategies._registration import register_start_methods
from ds_lightning.strategies.base import ClusterStrategy, StartMethod
from ds_lightning.strategies.capabilities import StrategyCapabilities

__all__ = ["PipelineStrategy"]


# torch 2.13's zero-bubble schedules run a checkpointed stage's forward again in each of their two backward passes.
_RECOMPUTE_TWICE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


class PipelineStrategy(TracedSplitting, StageCheckpoints, ClusterStrategy):
    """Pipeline model parallelism: the model is split into stages, one device per stage.

    Built on ``torch.distributed.pipelining``: each process wraps its stage in a ``PipelineStage`` and a torch schedule
    (``GPipe``, ``1F1B``, interleaved and zero-bubble variants) moves micro-batches between processes. With
    ``data_parallel_size > 1`` the whole pipeline is replicated and each stage's gradients are averaged across its
    replicas.

    The LightningModule's contract: the part to pipeline is the attribute named ``pipe_module``, an ``nn.Sequential``
    cut by layer counts or any module traced by torch's tracer and cut before named submodules (``split_points``);
    the last stage computes the loss with ``module.pipeline_loss(output, target)``; a batch is ``(input, target)``
    unless the module defines ``pipeline_batch(batch) -> (input, target)``, the input a tensor, or for a traced module
    a tuple or dict of them. Precision is ``32-true``, ``bf16-mixed`` or ``bf16-true``. The ordinary ``training_step``
    still runs on every rank and sees the pipeline's output, so what it logs reaches the progress bar and loggers as
    usual.

    The arguments ``DDPStrategy`` takes come first, in its positions (see
    :class:`~ds_lightning.strategies.ClusterStrategy`); those about torch's DDP wrapper are refused, since stage
    gradients are averaged over the data-parallel group without it. The pipeline options are keyword-only.

    Args:
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer, or :class:`~ds_lightning.environments.TFConfigEnvironment`.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        ddp_comm_state: refused (no DDP wrapper); must stay ``None``.
        ddp_comm_hook: refused (no DDP wrapper); must stay ``None``.
        ddp_comm_wrapper: refused (no DDP wrapper); must stay ``None``.
        model_averaging_period: refused (no DDP wrapper); must stay ``None``.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` picks NCCL for CUDA and gloo otherwise.
        timeout: how long any collective or point-to-point transfer may wait before the run fails instead of
            hanging: seconds or a ``timedelta``; ``None`` means torch's default (30 minutes).
        start_method: ``"popen"`` re-runs the script per rank; ``"spawn"``/``"fork"``/``"forkserver"`` use
            multiprocessing.
        schedule: the torch pipeline schedule.
        n_microbatches: micro-batches each batch is split into; the batch size must be a multiple of it.
        balance: layers per stage: ``None`` for equal counts, a list with one count per stage, or ``"auto"`` to
            profile each layer's time on a sample batch and minimise the slowest stage.
        pipe_module: name of the LightningModule's attribute to pipeline: an ``nn.Sequential``, or any module when
            it is traced (``split_points``).
        split_points: trace ``pipe_module`` with torch's tracer and cut it before these submodules (e.g.
            ``["blocks.2"]``), or ``"auto"`` to cut the children of its largest ``nn.ModuleList`` by ``balance``
            (equal counts, counts per stage, or ``"auto"`` for measured time). ``None`` traces with ``"auto"`` when
            ``pipe_module`` is not an ``nn.Sequential``. Stages may pass several tensors; a weight used on two stages
            (a tied head) stays one weight, its gradient summed over them.
        activation_checkpointing: recompute each stage's activations in the backward pass instead of storing them.
        data_parallel_size: replicas of the whole pipeline; world size must be stages x replicas (``-1`` infers it).
        stages_per_rank: stages each process runs; ``None`` picks 2 for interleaved and V-shaped schedules, else 1.
        trace_path: write the executed schedule of a few training steps as a Chrome trace (JSON) and a PNG timeline.
        trace_steps: training steps to trace (after one warm-up step).
        state_dict_type: ``"full"`` (one checkpoint file, every stage's part gathered on rank 0) or ``"sharded"`` (a
            folder in Lightning FSDP's layout: each stage writes its own part with ``torch.distributed.checkpoint``;
            it loads at another stage count, and ``consolidate_checkpoint`` makes one file of it).

    Raises:
        ValueError: for any invalid option, naming the value and the fix.

    """

    strategy_name = "ds_pipeline"
    capabilities = StrategyCapabilities(precision_plugin_wraps_forward=False)  # stages run in torch's schedule

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        *,
        schedule: ScheduleName = "1F1B",
        n_microbatches: int = 4,
        balance: list[int] | Literal["auto"] | None = None,
        pipe_module: str = "net",
        split_points: list[str] | Literal["auto"] | None = None,
        activation_checkpointing: bool = False,
        data_parallel_size: int = 1,
        stages_per_rank: int | None = None,
        trace_path: str | None = None,
        trace_steps: int = 3,
        state_dict_type: StateDictType = "full",
    ) -> None:
        self._spec = schedule_spec(schedule)
        self.schedule = canonical_name(schedule)
        check.integer("n_microbatches", n_microbatches, 1, "PipelineStrategy(n_microbatches=4)")
        balance = check_balance(balance)
        check.identifier(
            "pipe_module", pipe_module, "pipe_module='net' for the LightningModule's `self.net = nn.Sequential(...)`"
        )
        split_points = check_split_points(split_points)
        if isinstance(split_points, list) and balance is not None:
            raise ValueError(
                f"balance={balance!r} and split_points={split_points!r} both say where to cut; give one, or "
                "split_points='auto' with balance to cut the model's ModuleList by counts or measured time."
            )
        check.flag("activation_checkpointing", activation_checkpointing)
        if data_parallel_size != -1:
            check.integer("data_parallel_size", data_parallel_size, 1, "PipelineStrategy(data_parallel_size=2)")
        stages_per_rank = resolve_stages_per_rank(self.schedule, stages_per_rank)
        check.integer("trace_steps", trace_steps, 1, "PipelineStrategy(trace_steps=3)")
        super().__init__(
            accelerator,
            parallel_devices,
            cluster_environment,
            checkpoint_io,
            precision_plugin,
            ddp_comm_state,
            ddp_comm_hook,
            ddp_comm_wrapper,
            model_averaging_period,
            process_group_backend,
            timeout,
            start_method,
            state_dict_type=state_dict_type,
        )
        self._refuse_ddp_options(
            "ds_pipeline averages stage gradients over its data-parallel group without torch's DDP"
        )
        self.n_microbatches = n_microbatches
        self.balance = balance
        self.pipe_module = pipe_module
        self.split_points = split_points
        self.activation_checkpointing = activation_checkpointing
        self.data_parallel_size = data_parallel_size
        self.stages_per_rank = stages_per_rank
        self.trace_path = trace_path
        self.trace_steps = trace_steps
        self._layout: PipelineLayout | None = None
        self._groups: PipelineGroups | None = None
        self._recorder: SpanRecorder | None = None
        self.balance_used: list[int] | None = None
        # Kept after teardown: trainer.save_checkpoint() after fit() still consolidates the stages' optimizers.
        self._param_names: list[str] = []
        self._full_groups: list[list[list[str]]] = []
        self._full: nn.Module | None = None
        self._proxy: PipelinedModule | None = None
        self._proxy_parameters: tuple[PipelinedModule | None, list[nn.Parameter]] = (None, [])
        self._runtime: PipelineRuntime | None = None
        self._canonical: dict[str, str] = {}
        self._names: dict[nn.Parameter, str] = {}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_start_methods(
            strategy_registry, cls, "pipeline parallelism", (("ds_pipeline", "popen"), ("ds_pipeline_spawn", "spawn"))
        )

    # --- layout ---------------------------------------------------------------------------------------------------

    @property
    def layout(self) -> PipelineLayout:
        """Stages x replicas of this run (available once the world size is known)."""
        if self._layout is None:
            stages = len(self.balance) if isinstance(self.balance, list) else -1
            if isinstance(self.split_points, list):
                stages = len(self.split_points) + 1
            layout = PipelineLayout(self.world_size, self.data_parallel_size, self.stages_per_rank, stages)
            check_microbatches(self.schedule, self.n_microbatches, layout.stages, layout.pipeline_size)
            self._layout = layout
        return self._layout

    @property
    def pipeline_rank(self) -> int:
        """This process's position in its pipeline."""
        return self.layout.coordinates(self.global_rank)[1]

    @property
    def replica_rank(self) -> int:
        """Which pipeline replica this process belongs to."""
        return self.layout.coordinates(self.global_rank)[0]

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The ``("dp", "pp")`` mesh of the run, once processes have joined."""
        return self._groups.mesh if self._groups is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of a replica reads the same batches: the first needs the inputs, the last the targets.
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.replica_rank}

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        self._layout = None
        _ = self.layout  # validate stages x replicas = world size before any process starts

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Sub-groups are made here, with the run's timeout; every rank creates every group in the same order.
        self._groups = build_groups(self.layout, self.global_rank, self.root_device.type, self._timeout)

    # --- set-up -----------------------------------------------------------------------------------------------------

    def _resolve_balance(self, trainer: Trainer, module: LightningModule, seq: nn.Sequential) -> list[int]:
        stages = self.layout.stages
        if self.balance != "auto":
            return resolve_balance(len(seq), stages, self.balance)
        resolve_balance(len(seq), stages, None)
        sample = split.sample_input(trainer, module)
        balance, table = auto_balance(list(seq), sample, self.root_device, stages, agree=self._average_costs)
        rank_zero_info(f"ds_pipeline: balance='auto' chose {balance} ({table})")
        return balance

    def _split(self, trainer: Trainer, module: LightningModule) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        current = getattr(module, self.pipe_module, None)
        whole = self._full if isinstance(current, PipelinedModule) else current
        if split.is_traceable(whole) and (self.split_points is not None or not isinstance(whole, nn.Sequential)):
            return self._split_traced(trainer, module, cast(nn.Module, whole), fitting)
        seq = split.user_sequential(module, self.pipe_module) if whole is current else cast(nn.Sequential, whole)
        setattr(module, self.pipe_module, seq)  # a repeated setup starts from the whole model again
        split.check_contract(module, self.pipe_module, fitting)
        self._canonical = {}
        balance = self.balance_used = self._resolve_balance(trainer, module, seq)
        ranges = stage_layer_ranges(balance)
        if fitting:
            # Decided from the layout alone, so every rank raises together instead of some waiting in a collective.
            split.check_every_rank_trains(seq, ranges, self.layout, self._spec.style)
        stage_ids = self.layout.stage_indices(self.pipeline_rank, self._spec.style)
        self._param_names = [name for name, _ in module.named_parameters()]
        self._full = seq
        if self.activation_checkpointing and self.schedule in _RECOMPUTE_TWICE:
            rank_zero_warn(
                f"ds_pipeline: activation_checkpointing under schedule={self.schedule!r} re-runs each checkpointed"
                " forward up to 3 times per micro-batch (torch splits the backward in two passes): correct, but"
                " slower than under '1F1B' or 'Interleaved1F1B'."
            )
        stages = {s: StageModule([seq[i] for i in ranges[s]], self.activation_checkpointing) for s in stage_ids}
        assert self._groups is not None
        self._runtime = PipelineRuntime(
            stages, self.layout, self._spec, self.n_microbatches, self._groups, self.root_device, self._scaled_loss
        )
        self._proxy = PipelinedModule({i: seq[i] for s in stage_ids for i in ranges[s]}, self._runtime.evaluate)
        setattr(module, self.pipe_module, self._proxy)

    def _sync_replicas(self) -> None:
        # Like DDP at wrap time: every replica starts from replica 0's weights.
        if self.layout.data_parallel_size == 1:
            return
        assert self.lightning_module is not None and self._groups is not None
        source = dist.get_global_rank(self._groups.data, 0)
        for tensor in self.lightning_module.state_dict().values():
            if isinstance(tensor, torch.Tensor):
                dist.broadcast(tensor, src=source, group=self._groups.data)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        inner = check_pipeline_precision(self.precision_plugin)
        module = self.lightning_module
        inner.convert_module(module)  # before the split: bf16-true stages are traced and sized in bf16
        self._split(trainer, module)
        assert self._groups is not None and self._runtime is not None
        compile_stages(module, self._runtime.stages, "ds_pipeline")  # under trainer.fit(torch.compile(model))
        module.to(self.root_device)
        self.model = module
        self._sync_replicas()
        self._precision_plugin = GlobalNormPrecision(self._groups.pipeline, inner, self._runtime.duplicate_copies())
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._full_groups = pipe_state.gather_full_groups(
                self.optimizers, self._names_by_param(), self._param_names, self.world_size
            )
            _optimizers_to_device(self.optimizers, self.root_device)
            if trainer.accumulate_grad_batches > 1:
                rank_zero_info(
                    f"ds_pipeline: accumulate_grad_batches={trainer.accumulate_grad_batches} is honoured (gradients of "
                    "that many batches are summed and scaled like Lightning does); raising n_microbatches is usually "
                    "the cheaper way to a larger batch."
                )
        self.setup_precision_plugin()
        if self.trace_path is not None and trainer.state.fn == TrainerFn.FITTING:
            self._recorder = SpanRecorder(self.global_rank, steps=self.trace_steps, skip_steps=1)
            self._runtime.recorder = self._recorder

    # --- the training step ----------------------------------------------------------------------------------------

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.lightning_module is not None
        # The contract split.check_contract enforces; LightningModule does not declare it.
        pipeline_loss = cast(Callable[[torch.Tensor, torch.Tensor], torch.Tensor], self.lightning_module.pipeline_loss)
        loss = pipeline_loss(output, target)
        trainer = self.lightning_module._trainer
        accumulation = trainer.accumulate_grad_batches if trainer is not None else 1
        # Each micro-batch's mean loss, scaled so the summed gradients equal the whole batch's mean, divided over
        # accumulation the way Lightning divides the loss.
        return loss / (self.n_microbatches * accumulation)

    def _local_parameters(self) -> list[nn.Parameter]:
        assert self._proxy is not None
        # The proxy's parameters are fixed once it is built; listing them walks its modules, so once per proxy.
        if self._proxy_parameters[0] is not self._proxy:
            self._proxy_parameters = (self._proxy, list(self._proxy.parameters()))
        return [p for p in self._proxy_parameters[1] if p.requires_grad]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None and self._proxy is not None and self._runtime is not None
        inputs, target = split.split_batch(module, args[0] if args else kwargs["batch"])
        call_args, call_kwargs = split.as_call(self.precision_plugin.convert_input(inputs))
        rows = next(t.shape[0] for t in [*call_args, *call_kwargs.values()] if isinstance(t, torch.Tensor))
        microbatch.check_divisible(rows, self.n_microbatches)
        if self._recorder is not None:
            self._recorder.begin_step(module.trainer.global_step)
        with self._pipeline_precision.schedule_context():
            output = self._runtime.train(call_args, call_kwargs, target, self._local_parameters())
        self._proxy.prime(output)
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._proxy.unprime()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None and self._runtime is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._runtime.hand_over()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @property
    def _pipeline_precision(self) -> GlobalNormPrecision:
        assert isinstance(self.precision_plugin, GlobalNormPrecision)
        return self.precision_plugin

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self._eval_step(), self._pipeline_precision.schedule_context():
            return self.lightning_module.validation_step(*args, **kwargs)  # type: ignore[union-attr]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self._eval_step(), self._pipeline_precision.schedule_context():
            return self.lightning_module.test_step(*args, **kwargs)  # type: ignore[union-attr]

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self._pipeline_precision.schedule_context():
            return self.lightning_module.predict_step(*args, **kwargs)  # type: ignore[union-attr]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return microbatch.fit_loader(dataloader, self.n_microbatches, "ds_pipeline")

    # --- end of training ------------------------------------------------------------------------------------------

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        # Every rank gets the trained weights of every stage, so the module is whole again after fit().
        assert self.lightning_module is not None
        merged = self.merged_state_dict()
        if self._full is not None:
            prefix = f"{self.pipe_module}."
            self._full.load_state_dict({k[len(prefix) :]: v for k, v in merged.items() if k.startswith(prefix)})
        if self._recorder is not None:
            write_trace(
                self._recorder, self.world_size, self.global_rank, self.trace_path, f"ds_pipeline {self.schedule}"
            )

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and self._full is not None:
            setattr(module, self.pipe_module, self._full)
        self._full, self._proxy, self._runtime, self._recorder = None, None, None, None
        super().teardown()
