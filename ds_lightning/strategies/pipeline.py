"""``ds_pipeline``: pipeline model parallelism on ``torch.distributed.pipelining``, optionally x data parallelism."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning.pipeline import state as pipe_state
from ds_lightning.pipeline.layout import PipelineLayout
from ds_lightning.pipeline.partition import partition_by_cost, resolve_balance, stage_layer_ranges
from ds_lightning.pipeline.profile import profile_layers
from ds_lightning.pipeline.schedules import (
    ScheduleName,
    canonical_name,
    check_microbatches,
    make_forward_only,
    schedule_spec,
)
from ds_lightning.pipeline.stage import PipelinedSequential, StageModule, TracedStage
from ds_lightning.pipeline.trace import SpanRecorder, render_timeline_png, write_chrome_trace
from ds_lightning.strategies._cluster import (
    StartMethod,
    adopt_tf_config,
    check_launch_options,
    destroy_process_group_at_exit,
    pin_interfaces,
)
from ds_lightning.strategies._registration import register_start_methods
from ds_lightning.strategies._rendezvous import setup_distributed

log = logging.getLogger(__name__)

__all__ = ["PipelineStrategy"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
_HEADER = 10  # ndim, dtype, up to 8 dims


def _check_int(name: str, value: object, minimum: int, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}, e.g. PipelineStrategy({name}={example}).")


def check_every_rank_trains(seq: nn.Sequential, ranges: list[range], layout: PipelineLayout, style: str) -> None:
    """Refuse a split that leaves a process with no trainable parameter: its optimizer would be empty.

    Raises:
        ValueError: naming the process, its layers and the fix.

    """
    for rank in range(layout.pipeline_size):
        layers = [i for s in layout.stage_indices(rank, style) for i in ranges[s]]
        if not any(p.requires_grad for i in layers for p in seq[i].parameters()):
            kinds = ", ".join(type(seq[i]).__name__ for i in layers)
            raise ValueError(
                f"Pipeline process {rank} would hold only layers {layers} ({kinds}), which have no trainable "
                "parameters, so its optimizer would be empty. Give it a layer with parameters through `balance` "
                "(e.g. keep each activation with the layer before it), or use fewer stages."
            )


class _GlobalNormPrecision(Precision):
    """32-bit precision whose norm clipping uses the norm over all stages, like clipping the unsplit model."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self._group = group

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            squares += torch.linalg.vector_norm(grad.detach(), 2.0).float() ** 2
        dist.all_reduce(squares, group=self._group)
        # Same formula as torch.nn.utils.clip_grad_norm_.
        coefficient = torch.clamp(float(clip_val) / (squares.sqrt() + 1e-6), max=1.0)
        for grad in grads:
            grad.detach().mul_(coefficient.to(grad.device, grad.dtype))


class _Pipeline:
    """The stages and schedule for one (mode, input shape); built lazily, identically on every rank of a pipeline."""

    def __init__(self, stages: list[TracedStage], schedule: Any) -> None:
        self.schedule = schedule
        self.has_first = any(stage.is_first for stage in stages)
        self.has_last = any(stage.is_last for stage in stages)
        # The output's shape and dtype, learnt on the first step; like the activations torch infers once, they are
        # fixed for a given input shape.
        self.output_meta: tuple[list[int], torch.dtype] | None = None


class _DropPartialBatches:
    """Iterate a loader's first ``length`` batches: drops a last partial batch that micro-batching cannot split."""

    def __init__(self, loader: Any, length: int) -> None:
        self.loader = loader
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[Any]:
        for count, batch in enumerate(self.loader):
            if count >= self._length:
                return
            yield batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class PipelineStrategy(DDPStrategy):
    """Pipeline model parallelism: the model's ``nn.Sequential`` is split into stages, one device per stage.

    Built on ``torch.distributed.pipelining``: each process wraps its stage in a ``PipelineStage`` and a torch schedule
    (``GPipe``, ``1F1B``, interleaved and zero-bubble variants) moves micro-batches between processes. With
    ``data_parallel_size > 1`` the whole pipeline is replicated and each stage's gradients are averaged across its
    replicas.

    The LightningModule's contract: the part to pipeline is the ``nn.Sequential`` attribute named ``pipe_module``; the
    last stage computes the loss with ``module.pipeline_loss(output, target)``; a batch is ``(input, target)`` unless
    the module defines ``pipeline_batch(batch) -> (input, target)``. The ordinary ``training_step`` still runs on every
    rank and sees the pipeline's output, so what it logs reaches the progress bar and loggers as usual.

    Args:
        schedule: the torch pipeline schedule.
        n_microbatches: micro-batches each batch is split into; the batch size must be a multiple of it.
        balance: layers per stage: ``None`` for equal counts, a list with one count per stage, or ``"auto"`` to
            profile each layer's time on a sample batch and minimise the slowest stage.
        pipe_module: name of the LightningModule's ``nn.Sequential`` attribute to pipeline.
        activation_checkpointing: recompute each stage's activations in the backward pass instead of storing them.
        data_parallel_size: replicas of the whole pipeline; world size must be stages x replicas (``-1`` infers it).
        stages_per_rank: stages each process runs; ``None`` picks 2 for interleaved and V-shaped schedules, else 1.
        trace_path: write the executed schedule of a few training steps as a Chrome trace (JSON) and a PNG timeline.
        trace_steps: training steps to trace (after one warm-up step).
        timeout: seconds any collective or point-to-point transfer may wait before the run fails instead of hanging.
        start_method: ``"popen"`` re-runs the script per rank; ``"spawn"``/``"fork"``/``"forkserver"`` use
            multiprocessing.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` picks NCCL for CUDA and gloo otherwise.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer, or :class:`~ds_lightning.environments.TFConfigEnvironment`.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.

    Raises:
        ValueError: for any invalid option, naming the value and the fix.

    """

    strategy_name = "ds_pipeline"

    def __init__(
        self,
        schedule: ScheduleName = "1F1B",
        n_microbatches: int = 4,
        balance: list[int] | Literal["auto"] | None = None,
        pipe_module: str = "net",
        activation_checkpointing: bool = False,
        data_parallel_size: int = 1,
        stages_per_rank: int | None = None,
        trace_path: str | None = None,
        trace_steps: int = 3,
        timeout: float = 1800.0,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self._spec = schedule_spec(schedule)
        self.schedule = canonical_name(schedule)
        _check_int("n_microbatches", n_microbatches, 1, "4")
        if balance is not None and balance != "auto":
            if isinstance(balance, str) or not isinstance(balance, (list, tuple)):
                raise ValueError(
                    f"balance={balance!r} must be None, 'auto' or a list of layers per stage, e.g. [3, 2]."
                )
            for count in balance:
                _check_int("balance entries", count, 1, "[3, 2]")
        if not isinstance(pipe_module, str) or not pipe_module.isidentifier():
            raise ValueError(f"pipe_module={pipe_module!r} must name an attribute of the LightningModule, e.g. 'net'.")
        if not isinstance(activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing={activation_checkpointing!r} must be True or False.")
        if data_parallel_size != -1:
            _check_int("data_parallel_size", data_parallel_size, 1, "2")
        default_spr = 2 if self._spec.multi_stage else 1
        if stages_per_rank is None:
            stages_per_rank = default_spr
        _check_int("stages_per_rank", stages_per_rank, 1, str(default_spr))
        if not self._spec.multi_stage and stages_per_rank != 1:
            raise ValueError(
                f"schedule={self.schedule!r} runs one stage per process, but stages_per_rank={stages_per_rank}; use "
                "schedule='Interleaved1F1B' (or another multi-stage schedule) for several stages per process."
            )
        if self._spec.style == "v" and stages_per_rank != 2:
            raise ValueError(
                f"schedule={self.schedule!r} runs exactly 2 stages per process (a V shape), but "
                f"stages_per_rank={stages_per_rank}; leave stages_per_rank unset."
            )
        _check_int("trace_steps", trace_steps, 1, "3")
        check_launch_options("PipelineStrategy", timeout, start_method, process_group_backend)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout),
            start_method=start_method,
        )
        self.n_microbatches = n_microbatches
        self.balance = list(balance) if isinstance(balance, (list, tuple)) else balance
        self.pipe_module = pipe_module
        self.activation_checkpointing = activation_checkpointing
        self.data_parallel_size = data_parallel_size
        self.stages_per_rank = stages_per_rank
        self.trace_path = trace_path
        self.trace_steps = trace_steps
        self._layout: PipelineLayout | None = None
        self._mesh: DeviceMesh | None = None
        self._pp_group: dist.ProcessGroup | None = None
        self._dp_group: dist.ProcessGroup | None = None
        self._out_group: dist.ProcessGroup | None = None
        self._recorder: SpanRecorder | None = None
        self.balance_used: list[int] | None = None
        # Kept after teardown: trainer.save_checkpoint() after fit() still consolidates the stages' optimizers.
        self._param_names: list[str] = []
        self._full_groups: list[list[list[str]]] = []
        self._reset_model_state()

    def _reset_model_state(self) -> None:
        self._full: nn.Sequential | None = None
        self._proxy: PipelinedSequential | None = None
        self._stage_ids: list[int] = []
        self._stage_modules: dict[int, StageModule] = {}
        self._pipelines: dict[tuple[Any, ...], _Pipeline] = {}
        self._fresh_grads: list[torch.Tensor | None] | None = None
        self._warned_sizes: set[int] = set()

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
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of a replica reads the same batches: the first needs the inputs, the last the targets.
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.replica_rank}

    @override
    def set_world_ranks(self) -> None:
        self.cluster_environment, self._num_nodes = adopt_tf_config(
            "ds_pipeline", self.cluster_environment, self._num_nodes
        )
        super().set_world_ranks()
        self._layout = None
        _ = self.layout  # validate stages x replicas = world size before any process starts

    @override
    def setup_distributed(self) -> None:
        setup_distributed(self)  # rank 0's rendezvous store listens on the main address only

    @override
    def setup_environment(self) -> None:
        pin_interfaces(self.cluster_environment)
        super().setup_environment()
        destroy_process_group_at_exit(self._get_process_group_backend())
        layout = self.layout
        grid = torch.arange(layout.world_size).view(layout.data_parallel_size, layout.pipeline_size)
        # Sub-groups are made here, with the run's timeout; every rank creates every group in the same order.
        pp_groups = [dist.new_group(row.tolist(), timeout=self._timeout) for row in grid]
        dp_groups = [dist.new_group(col.tolist(), timeout=self._timeout) for col in grid.t()]
        # The output broadcast has groups of its own, so the other stages can post it before the schedule runs
        # without queueing it ahead of the schedule's transfers.
        out_groups = [dist.new_group(row.tolist(), timeout=self._timeout) for row in grid]
        replica, pipeline_rank = layout.coordinates(self.global_rank)
        self._pp_group, self._dp_group = pp_groups[replica], dp_groups[pipeline_rank]
        self._out_group = out_groups[replica]
        self._mesh = DeviceMesh.from_group(
            [self._dp_group, self._pp_group], self.root_device.type, mesh=grid, mesh_dim_names=("dp", "pp")
        )

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The ``("dp", "pp")`` mesh of the run, once processes have joined."""
        return self._mesh

    # --- splitting the model --------------------------------------------------------------------------------------

    def _user_sequential(self, module: LightningModule) -> nn.Sequential:
        seq = getattr(module, self.pipe_module, None)
        if isinstance(seq, PipelinedSequential) and self._full is not None:
            return self._full
        if not isinstance(seq, nn.Sequential):
            found = "no such attribute" if seq is None else f"a {type(seq).__name__}"
            raise TypeError(
                f"ds_pipeline splits the nn.Sequential `{type(module).__name__}.{self.pipe_module}`, but found "
                f"{found}. Put the layers to pipeline in `self.{self.pipe_module} = nn.Sequential(...)`, or name the "
                "attribute with PipelineStrategy(pipe_module=...)."
            )
        return seq

    def _check_contract(self, module: LightningModule, fitting: bool) -> None:
        if fitting and not callable(getattr(module, "pipeline_loss", None)):
            raise TypeError(
                f"ds_pipeline computes the loss on the last stage with `{type(module).__name__}.pipeline_loss(output, "
                "target)`, which is missing. Add e.g. `def pipeline_loss(self, output, target): return "
                "F.cross_entropy(output, target)` and use it in training_step too."
            )
        seq = getattr(module, self.pipe_module)
        outside = [
            name
            for name, p in module.named_parameters()
            if p.requires_grad and not any(p is q for q in seq.parameters())
        ]
        if fitting and outside:
            raise ValueError(
                f"ds_pipeline trains only the parameters inside `{self.pipe_module}`, but {outside[:5]} are outside it "
                f"and would never be updated. Move those layers into `self.{self.pipe_module}` (nn.Sequential)."
            )

    def _sample_input(self, trainer: Trainer, module: LightningModule) -> torch.Tensor:
        sample = module.example_input_array
        if isinstance(sample, torch.Tensor):
            return sample
        if trainer.state.fn == TrainerFn.FITTING:
            source = trainer.fit_loop._data_source
            if source.is_defined():
                loader = source.dataloader()
                batch = next(iter(loader))
                return self._split_batch(module, batch)[0]
        raise ValueError(
            "balance='auto' profiles the layers on a sample input: set `self.example_input_array` in your "
            "LightningModule, or give an explicit balance such as balance=[3, 2]."
        )

    def _resolve_balance(self, trainer: Trainer, module: LightningModule, seq: nn.Sequential) -> list[int]:
        stages = self.layout.stages
        if self.balance != "auto":
            return resolve_balance(len(seq), stages, self.balance)
        resolve_balance(len(seq), stages, None)
        sample = self._sample_input(trainer, module)
        profiles = profile_layers(list(seq), sample, self.root_device)
        costs = torch.tensor([p.seconds for p in profiles], dtype=torch.float64, device=self.root_device)
        # Timings differ per process; averaging them makes every rank choose the same split.
        dist.all_reduce(costs)
        costs = (costs / self.world_size).tolist()
        balance = partition_by_cost(costs, stages)
        table = ", ".join(
            f"stage {s}: layers {r.start}-{r.stop - 1} {sum(costs[i] for i in r) * 1e3:.2f} ms "
            f"{sum(profiles[i].memory_bytes for i in r) / 2**20:.1f} MiB"
            for s, r in enumerate(stage_layer_ranges(balance))
        )
        rank_zero_info(f"ds_pipeline: balance='auto' chose {balance} ({table})")
        return balance

    def _split(self, trainer: Trainer, module: LightningModule) -> None:
        seq = self._user_sequential(module)
        setattr(module, self.pipe_module, seq)  # a repeated setup starts from the whole model again
        self._check_contract(module, trainer.state.fn == TrainerFn.FITTING)
        balance = self._resolve_balance(trainer, module, seq)
        self.balance_used = balance
        ranges = stage_layer_ranges(balance)
        if trainer.state.fn == TrainerFn.FITTING:
            # Decided from the layout alone, so every rank raises together instead of some waiting in a collective.
            check_every_rank_trains(seq, ranges, self.layout, self._spec.style)
        self._stage_ids = self.layout.stage_indices(self.pipeline_rank, self._spec.style)
        owned = {i: seq[i] for s in self._stage_ids for i in ranges[s]}
        self._param_names = [name for name, _ in module.named_parameters()]
        self._full = seq
        self._stage_modules = {
            s: StageModule([seq[i] for i in ranges[s]], self.activation_checkpointing) for s in self._stage_ids
        }
        self._proxy = PipelinedSequential(owned, self._evaluate)
        setattr(module, self.pipe_module, self._proxy)
        self._pipelines = {}

    def _sync_replicas(self) -> None:
        # Like DDP at wrap time: every replica starts from replica 0's weights.
        if self.layout.data_parallel_size == 1:
            return
        assert self.lightning_module is not None
        source = dist.get_global_rank(self._dp_group, 0)
        for tensor in self.lightning_module.state_dict().values():
            if isinstance(tensor, torch.Tensor):
                dist.broadcast(tensor, src=source, group=self._dp_group)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        if type(self.precision_plugin) is not Precision and not isinstance(self.precision_plugin, _GlobalNormPrecision):
            raise ValueError(
                f"ds_pipeline runs in 32-bit precision for now, but the Trainer chose "
                f"{type(self.precision_plugin).__name__}; remove `precision=` from the Trainer (or set '32-true')."
            )
        module = self.lightning_module
        self._split(trainer, module)
        module.to(self.root_device)
        self.model = module
        self._sync_replicas()
        assert self._pp_group is not None
        self._precision_plugin = _GlobalNormPrecision(self._pp_group)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._gather_optimizer_groups()
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

    def _names_by_param(self) -> dict[nn.Parameter, str]:
        assert self.lightning_module is not None
        return {p: name for name, p in self.lightning_module.named_parameters()}

    def _gather_optimizer_groups(self) -> None:
        names = self._names_by_param()
        local = [pipe_state.group_names(opt, names) for opt in self.optimizers]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        self._full_groups = [
            pipe_state.full_group_names([stage[i] for stage in gathered], self._param_names)
            for i in range(len(self.optimizers))
        ]

    # --- building pipelines ---------------------------------------------------------------------------------------

    def _pipeline(self, mode: str, shape: torch.Size, dtype: torch.dtype) -> _Pipeline:
        key = (mode, tuple(shape), dtype, torch.is_inference_mode_enabled())
        if key in self._pipelines:
            return self._pipelines[key]
        training = mode == "train"
        recorder = self._recorder if training else None
        stages = [
            TracedStage(
                self._stage_modules[s],
                s,
                self.layout.stages,
                self.root_device,
                group=self._pp_group,
                recorder=recorder,
            )
            for s in self._stage_ids
        ]
        loss_fn = self._scaled_loss if training else None
        kwargs: dict[str, Any] = {"n_microbatches": self.n_microbatches, "loss_fn": loss_fn, "scale_grads": False}
        torch_class = self._spec.torch_class
        schedule = torch_class(stages, **kwargs) if self._spec.multi_stage else torch_class(stages[0], **kwargs)
        if not training and self._spec.style == "v":
            make_forward_only(schedule)
        pipeline = self._pipelines[key] = _Pipeline(stages, schedule)
        return pipeline

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.lightning_module is not None
        loss = self.lightning_module.pipeline_loss(output, target)
        # Each micro-batch's mean loss, scaled so the summed gradients equal the whole batch's mean, divided over
        # accumulation the way Lightning divides the loss.
        return loss / (self.n_microbatches * self._accumulation)

    @property
    def _accumulation(self) -> int:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        return trainer.accumulate_grad_batches if trainer is not None else 1

    def _last_stage_owner(self) -> int:
        last = self.layout.stages - 1
        return next(
            r for r in range(self.layout.pipeline_size) if last in self.layout.stage_indices(r, self._spec.style)
        )

    def _output_source(self) -> int:
        return dist.get_global_rank(self._pp_group, self._last_stage_owner())

    def _learn_output_meta(self, output: torch.Tensor | None, pipeline: _Pipeline) -> None:
        """On a pipeline's first run, tell every stage the output's shape and dtype (fixed per input shape after)."""
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.root_device)
        valid = isinstance(output, torch.Tensor) and output.dim() <= _HEADER - 2 and output.dtype in _DTYPES
        if pipeline.has_last:
            if valid:
                assert isinstance(output, torch.Tensor)
                header[0], header[1] = output.dim(), _DTYPES.index(output.dtype)
                header[2 : 2 + output.dim()] = torch.tensor(output.shape)
            else:
                header[0] = -1  # every stage raises, instead of the others waiting for data that never comes
        dist.broadcast(header, src=self._output_source(), group=self._out_group)
        if int(header[0]) < 0:
            raise TypeError(
                "ds_pipeline needs the last layer to return one tensor (of at most 8 dims and a standard dtype); "
                f"the last stage returned {type(output).__name__ if pipeline.has_last else 'something else'}."
            )
        pipeline.output_meta = (header[2 : 2 + int(header[0])].tolist(), _DTYPES[int(header[1])])

    def _run(self, pipeline: _Pipeline, x: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        """Run the schedule and return the last stage's output on every stage of the pipeline."""
        args = (x,) if pipeline.has_first else ()
        kwargs: dict[str, Any] = {}
        if target is not None and pipeline.has_last:
            kwargs["target"] = target
        received, pending = None, None
        if pipeline.output_meta is not None and not pipeline.has_last:
            # Post the receive now: the broadcast then overlaps with this stage's remaining work in the schedule.
            shape, dtype = pipeline.output_meta
            received = torch.empty(shape, dtype=dtype, device=self.root_device)
            pending = dist.broadcast(received, src=self._output_source(), group=self._out_group, async_op=True)
        run = pipeline.schedule.eval if target is None else pipeline.schedule.step
        output = run(*args, **kwargs)
        if pipeline.output_meta is None:
            self._learn_output_meta(output, pipeline)
            shape, dtype = pipeline.output_meta  # type: ignore[misc]
            received = None if pipeline.has_last else torch.empty(shape, dtype=dtype, device=self.root_device)
            if received is not None:
                pending = dist.broadcast(received, src=self._output_source(), group=self._out_group, async_op=True)
        if pipeline.has_last:
            shape, dtype = pipeline.output_meta
            if list(output.shape) != shape or output.dtype != dtype:
                raise RuntimeError(
                    f"The pipeline's output changed from {shape} {dtype} to {list(output.shape)} {output.dtype} for "
                    "the same input shape; ds_pipeline needs a fixed output shape per input shape."
                )
            output = output.detach().contiguous()
            dist.broadcast(output, src=self._output_source(), group=self._out_group)
            return output
        assert pending is not None and received is not None
        pending.wait()
        return received

    def _evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Forward-only pipeline, collective over the pipeline's ranks; pads the rows to a multiple of micro-batches."""
        rows = x.shape[0]
        padded = max(self.n_microbatches, math.ceil(rows / self.n_microbatches) * self.n_microbatches)
        if padded != rows:
            if rows not in self._warned_sizes:
                self._warned_sizes.add(rows)
                rank_zero_info(
                    f"ds_pipeline: an evaluation batch of {rows} rows is padded to {padded} (a multiple of "
                    f"n_microbatches={self.n_microbatches}); the padding rows are cut from the outputs."
                )
            x = torch.cat([x, x[-1:].expand(padded - rows, *x.shape[1:])])
        pipeline = self._pipeline("eval", x.shape, x.dtype)
        return self._run(pipeline, x, None)[:rows]

    # --- the training step ----------------------------------------------------------------------------------------

    def _split_batch(self, module: LightningModule, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        split = getattr(module, "pipeline_batch", None)
        pair = split(batch) if callable(split) else batch
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], torch.Tensor):
            raise TypeError(
                f"ds_pipeline needs each batch as (input, target), got {type(batch).__name__}; define "
                f"`{type(module).__name__}.pipeline_batch(batch) -> (input, target)` to say how to split it."
            )
        return pair[0], pair[1]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None and self._proxy is not None
        batch = args[0] if args else kwargs["batch"]
        x, target = self._split_batch(module, batch)
        if x.shape[0] % self.n_microbatches:
            raise ValueError(
                f"A training batch has {x.shape[0]} rows, which n_microbatches={self.n_microbatches} does not divide. "
                "Use a batch size that is a multiple of n_microbatches (map-style loaders drop only a partial last "
                "batch automatically)."
            )
        if self._recorder is not None:
            self._recorder.begin_step(module.trainer.global_step)
        params = self._local_parameters()
        # The schedule runs forward and backward here, but Lightning zeroes gradients after training_step and before
        # backward: park the new gradients and hand them over in backward().
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        output = self._run(self._pipeline("train", x.shape, x.dtype), x, target)
        self._fresh_grads = [p.grad for p in params]
        for p, grad in zip(params, earlier, strict=True):
            p.grad = grad
        self._proxy.prime(output)
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._proxy.unprime()

    def _local_parameters(self) -> list[nn.Parameter]:
        assert self._proxy is not None
        return [p for p in self._proxy.parameters() if p.requires_grad]

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        fresh, self._fresh_grads = self._fresh_grads, None
        if fresh is None:
            raise RuntimeError(
                "ds_pipeline computes gradients in the pipeline schedule of training_step; manual_backward or a second "
                "backward per step has no new gradients to apply."
            )
        params = self._local_parameters()
        fresh = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, fresh, strict=True)]
        if self.layout.data_parallel_size > 1 and fresh:
            flat = torch.cat([g.reshape(-1) for g in fresh])
            dist.all_reduce(flat, group=self._dp_group)
            flat /= self.layout.data_parallel_size
            fresh = [chunk.view_as(g) for chunk, g in zip(flat.split([g.numel() for g in fresh]), fresh, strict=True)]
        for p, grad in zip(params, fresh, strict=True):
            p.grad = grad if p.grad is None else p.grad + grad
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.lightning_module.validation_step(*args, **kwargs)  # type: ignore[union-attr]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.lightning_module.test_step(*args, **kwargs)  # type: ignore[union-attr]

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.lightning_module.predict_step(*args, **kwargs)  # type: ignore[union-attr]

    # --- data -----------------------------------------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        batch_size = getattr(dataloader, "batch_size", None)
        if not isinstance(batch_size, int):
            return dataloader
        m = self.n_microbatches
        if batch_size % m:
            raise ValueError(
                f"The training batch size {batch_size} is not a multiple of n_microbatches={m}: every micro-batch must "
                f"have the same size. Use batch_size={max(m, batch_size - batch_size % m)} or n_microbatches that "
                f"divides {batch_size}."
            )
        try:
            length = len(dataloader)  # type: ignore[arg-type]
            samples = len(dataloader.sampler)  # type: ignore[attr-defined]
        except TypeError:
            return dataloader
        last = samples % batch_size
        if getattr(dataloader, "drop_last", False) or last == 0 or last % m == 0:
            return dataloader
        rank_zero_warn(
            f"ds_pipeline: the last training batch of each epoch has {last} samples, which n_microbatches={m} does "
            f"not divide; it is dropped. Set drop_last=True, or a dataset size per replica that is a multiple of {m}."
        )
        return _DropPartialBatches(dataloader, length - 1)

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def _gather(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        # Replicas hold identical copies; replica 0's stages are the complete model.
        return [gathered[r] for r in range(self.layout.pipeline_size)]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        if self._full is None or not dist.is_initialized():
            return local
        merged: dict[str, Any] = {}
        for part in self._gather(local):
            merged.update(part)
        return merged

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        raw = getattr(optimizer, "_optimizer", optimizer)
        index = next(i for i, opt in enumerate(self.optimizers) if opt is raw or opt is optimizer)
        named = pipe_state.named_state(raw, self._names_by_param())
        named = {
            "param_groups": named["param_groups"],
            "state": {
                k: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                for k, s in named["state"].items()
            },
        }
        return pipe_state.consolidate(self._gather(named), self._full_groups[index])

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        names = self._names_by_param()
        for index, (optimizer, full) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"], strict=False)):
            local_groups = pipe_state.group_names(optimizer, names)
            optimizer.load_state_dict(pipe_state.localize(full, self._full_groups[index], local_groups))
            _optimizers_to_device([optimizer], self.root_device)

    # --- end of training ------------------------------------------------------------------------------------------

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        # Every rank gets the trained weights of every stage, so the module is whole again after fit().
        assert self.lightning_module is not None
        merged = self.lightning_module_state_dict()
        if self._full is not None:
            prefix = f"{self.pipe_module}."
            full_state = {k[len(prefix) :]: v for k, v in merged.items() if k.startswith(prefix)}
            self._full.load_state_dict(full_state, strict=True)
        if self._recorder is not None:
            self._write_trace()

    def _write_trace(self) -> None:
        assert self._recorder is not None
        payloads: list[Any] = [None] * self.world_size
        dist.all_gather_object(payloads, self._recorder.to_payload())
        if self.global_rank != 0 or self.trace_path is None:
            return
        spans = [span for payload in payloads for span in SpanRecorder.from_payload(payload)]
        path = write_chrome_trace(spans, self.trace_path)
        rank_zero_info(f"ds_pipeline: wrote the schedule trace of {len(spans)} spans to {path}")
        try:
            png = render_timeline_png(spans, path.with_suffix(".png"), title=f"ds_pipeline {self.schedule}")
            rank_zero_info(f"ds_pipeline: timeline at {png}")
        except ImportError as err:
            rank_zero_warn(f"ds_pipeline: no PNG timeline ({err}).")

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and self._full is not None:
            setattr(module, self.pipe_module, self._full)
        self._reset_model_state()
        self._recorder = None
        super().teardown()
