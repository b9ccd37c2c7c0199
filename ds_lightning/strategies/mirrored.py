"""``ds_mirrored``: synchronous data parallelism, one full replica per device, on Lightning's DDP and torch DDP."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.checkpoint.layout import SavedShards
from ds_lightning.checkpoint.options import StateDictType
from ds_lightning.checkpoint.strategy_hooks import sharded_parts
from ds_lightning.comm.auto import AutoState
from ds_lightning.comm.compression import GradientCompressor, get
from ds_lightning.comm.compression.checkpoint_state import add_compression_state, load_compression_state
from ds_lightning.comm.hierarchical import HierarchicalSetting, host_groups
from ds_lightning.data.eval_shards import uneven_batch_counts
from ds_lightning.data.even_batches import even_batches
from ds_lightning.sharding import (
    ShardingEngineSetting,
    check_sharding_engine,
    check_sharding_options,
    consolidated_state,
    load_sharded_states,
    resolve_parameter_sharding,
    shard_optimizers,
)
from ds_lightning.sharding.sharded_checkpoints import load_zero_partitions, zero_partition_state
from ds_lightning.strategies._fsdp2_mixin import FullyShardedSteps
from ds_lightning.strategies._registration import register_start_methods
from ds_lightning.strategies.base import ClusterStrategy, StartMethod
from ds_lightning.strategies.capabilities import StrategyCapabilities

log = logging.getLogger(__name__)

__all__ = ["MirroredStrategy"]

_COLLECTIVE_FAILURE = re.compile(r"timed? ?out|timeout|pair closure|connection closed|connection reset", re.IGNORECASE)


class MirroredStrategy(FullyShardedSteps, ClusterStrategy):
    """Synchronous data parallelism: every device holds a full replica and gradients are averaged every step.

    The counterpart of ``tf.distribute.MirroredStrategy`` / ``MultiWorkerMirroredStrategy``, built on Lightning's
    :class:`~lightning.pytorch.strategies.DDPStrategy` and torch's ``DistributedDataParallel`` (NCCL on CUDA, gloo on
    CPU). With ``TF_CONFIG`` set, each chief/worker task becomes one node of the run.

    ``MirroredStrategy`` is a drop-in for ``DDPStrategy``: it takes every ``DDPStrategy`` argument in the same
    position (``MirroredStrategy(accelerator)`` works as ``DDPStrategy(accelerator)`` does), forwards extra keyword
    arguments to torch's ``DistributedDataParallel`` (e.g. ``broadcast_buffers=False``) and runs a user's own
    ``ddp_comm_hook`` on every backend. Its own options are keyword-only, after those.

    Args:
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer, or :class:`~ds_lightning.environments.TFConfigEnvironment`.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        ddp_comm_state: state for ``ddp_comm_hook``.
        ddp_comm_hook: your own torch DDP comm hook, instead of ``gradient_compression`` (setting both is an error).
        ddp_comm_wrapper: wraps ``ddp_comm_hook`` (e.g. torch's ``fp16_compress_wrapper``).
        model_averaging_period: steps between model averages under torch's post-local SGD hook.
        process_group_backend: ``"gloo"``, ``"nccl"``, ... ; ``None`` picks NCCL for CUDA and gloo otherwise.
        timeout: how long any collective may wait before the run fails instead of hanging: seconds (a number) or a
            ``timedelta``; ``None`` means torch's default (30 minutes).
        start_method: ``"popen"`` re-runs the script per rank (like ``ddp``); ``"spawn"``/``"fork"``/``"forkserver"``
            use multiprocessing (like ``ddp_spawn``).
        gradient_compression: how gradients cross the wire, a method of :mod:`ds_lightning.comm.compression`:
            ``"none"`` (DDP's all-reduce), ``"fp16"`` or ``"bf16"`` (half-width all-reduce), ``"powersgd"`` (low-rank
            PowerSGD with error feedback, checkpointed) or ``"auto"`` (probe the link at set-up and every
            ``auto_interval`` steps and run whichever of ``none``, ``fp16`` and ``powersgd`` a cost model predicts
            fastest; the choice and its figures are logged). ``"topk"`` serves parameter-server pushes only.
        powersgd_rank: PowerSGD's approximation rank; higher is more accurate and sends more bytes. Under ``"auto"``
            PowerSGD runs at exactly this rank: auto never lowers it, so set the lowest rank your model tolerates.
        powersgd_start_iter: plain all-reduce steps before PowerSGD starts (under ``"auto"``: before it may be
            chosen).
        auto_interval: under ``gradient_compression="auto"``, steps (gradient synchronisations) between link probes
            and re-decisions.
        bucket_cap_mb: DDP gradient bucket size in MiB.
        static_graph: tell DDP the set of used parameters never changes (enables extra optimisations).
        find_unused_parameters: let DDP detect parameters that receive no gradient in a step.
        gradient_as_bucket_view: let gradients live inside DDP's communication buckets, saving a copy per step and
            the memory of a second gradient buffer (do not ``detach_()`` gradients in place when it is on). On by
            default here, on purpose, although torch's ``DistributedDataParallel`` (and so ``DDPStrategy``) defaults
            to ``False``; pass ``gradient_as_bucket_view=False`` for torch's behaviour.
        even_batches: give every rank the same number of training batches (capping to the shortest rank) so uneven
            inputs cannot hang gradient synchronisation. Validation and test shards are never capped: each sample is
            evaluated exactly once (see docs/mirrored.md, "Uneven inputs").
        shard_optimizer_state: each rank keeps and steps 1/N of the optimizer state; checkpoints still hold the
            whole state, in the plain layout (see :mod:`ds_lightning.sharding`).
        sharding_engine: under ``shard_optimizer_state=True``: ``"zero"`` (ZeRO stage 1, torch's
            ``ZeroRedundancyOptimizer`` behind DDP: whole tensors per rank, composes with every DDP option) or
            ``"fsdp2"`` (torch's ``fully_shard`` instead of DDP: every tensor split over the ranks; no gradient
            compression, comm hooks, two-level all-reduce, model averaging or load balancing). ``"auto"`` (the
            default) is ``"fsdp2"`` under ``shard_parameters=True`` and ``"zero"`` otherwise.
        shard_parameters: ZeRO stage 3: parameters, gradients and optimizer state are each 1/N per rank between
            uses (the fsdp2 engine, each block gathered for its forward and again for its backward). Implies
            ``shard_optimizer_state=True`` and ``sharding_engine="fsdp2"`` (``"zero"`` is refused). Under
            ``precision="bf16-mixed"`` blocks gather bf16 parameters and reduce fp32 gradients (see
            :mod:`ds_lightning.sharding.zero3`).
        cpu_offload: with ``shard_parameters=True``: sharded parameters, gradients and optimizer state live in host
            memory (torch's ``CPUOffloadPolicy``); the optimizer steps on the CPU.
        hierarchical: two-level all-reduce: reduce inside each host, all-reduce between hosts' leaders (compressed
            there only, when ``gradient_compression`` is set), broadcast inside the host. ``"auto"`` uses it with more
            than one host and more than one process on some host; ``True`` does the same (flat with one host);
            ``False`` always takes the flat all-reduce.
        state_dict_type: ``"full"`` (one file, gathered on rank 0) or ``"sharded"`` (a folder of each rank's own part
            under every engine, loadable at another world size and engine; see docs/checkpoints.md).
        **kwargs: passed on to torch's ``DistributedDataParallel``, e.g. ``broadcast_buffers=False``.

    Raises:
        ValueError: for any out-of-range option, naming the value and the fix.

    """

    strategy_name = "ds_mirrored"
    capabilities = StrategyCapabilities(weights_rank_gradients=True)  # balance_batches, gradient_weight

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
        gradient_compression: str = "none",
        powersgd_rank: int = 2,
        powersgd_start_iter: int = 10,
        auto_interval: int = 500,
        bucket_cap_mb: float = 25.0,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        even_batches: bool = True,
        shard_optimizer_state: bool = False,
        sharding_engine: ShardingEngineSetting = "auto",
        hierarchical: HierarchicalSetting = "auto",
        shard_parameters: bool = False,
        cpu_offload: bool = False,
        state_dict_type: StateDictType = "full",
        **kwargs: Any,
    ) -> None:
        method = get(gradient_compression, use="all_reduce")
        shard_optimizer_state, sharding_engine = resolve_parameter_sharding(
            shard_parameters, cpu_offload, shard_optimizer_state, sharding_engine
        )
        check_sharding_engine(
            sharding_engine,
            shard_optimizer_state,
            gradient_compression=gradient_compression,
            ddp_comm_hook=ddp_comm_hook,
            hierarchical=hierarchical,
            model_averaging_period=model_averaging_period,
            shard_parameters=shard_parameters,
        )
        check_sharding_options(shard_optimizer_state, model_averaging_period)
        if ddp_comm_hook is not None and not method.builtin:
            raise ValueError(
                f"ddp_comm_hook={ddp_comm_hook!r} and gradient_compression={gradient_compression!r} both decide how"
                " gradients are all-reduced, and DDP runs one comm hook: leave gradient_compression='none' to run"
                " your hook, or remove ddp_comm_hook."
            )
        if not (isinstance(hierarchical, bool) or hierarchical == "auto"):
            raise ValueError(f"hierarchical={hierarchical!r} is not a choice: use True, False or 'auto'.")
        if hierarchical is True:
            method.require("two_level")
        if ddp_comm_hook is not None and hierarchical is True:
            raise ValueError(
                f"hierarchical=True runs ds_mirrored's own two-level comm hook, but ddp_comm_hook={ddp_comm_hook!r}"
                " replaces it: remove ddp_comm_hook, or set hierarchical='auto' or False to run your hook."
            )
        check.number("bucket_cap_mb", bucket_cap_mb, "MirroredStrategy(bucket_cap_mb=25)", above=0)
        for flag_name, flag in (
            ("static_graph", static_graph),
            ("find_unused_parameters", find_unused_parameters),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("even_batches", even_batches),
        ):
            check.flag(flag_name, flag)
        self._compressor = GradientCompressor(
            gradient_compression,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
            auto_interval=auto_interval,
        )
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
            bucket_cap_mb=bucket_cap_mb,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            state_dict_type=state_dict_type,
            **kwargs,
        )
        self.gradient_compression = gradient_compression
        self.auto_interval = auto_interval
        self.even_batches = even_batches
        self.shard_optimizer_state = shard_optimizer_state
        self.sharding_engine = sharding_engine
        self.shard_parameters, self.cpu_offload = shard_parameters, cpu_offload
        self.hierarchical = hierarchical
        self._pending_compression_state: dict[str, Any] | None = None
        self._train_loader_factory: Callable[[Any], Any] | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_start_methods(
            strategy_registry,
            cls,
            "mirrored data parallelism",
            (("ds_mirrored", "popen"), ("ds_mirrored_spawn", "spawn"), ("ds_mirrored_fork", "fork")),
        )

    # --- DDP wrapping and compression -----------------------------------------------------------------------------

    @override
    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            super()._register_ddp_hooks()  # the user's own hook instead of ours
            return
        # Lightning registers comm hooks on CUDA only; ours must work on gloo too.
        assert isinstance(self.model, DistributedDataParallel)
        setting = self.hierarchical
        if setting == "auto" and "two_level" not in self._compressor.method.uses:
            # The method drives the flat all-reduce only; hierarchical=True with it is refused at construction.
            rank_zero_info(
                f"ds_mirrored: gradient_compression={self.gradient_compression!r} runs the flat all-reduce (no two"
                " levels)."
            )
            setting = False
        hosts = host_groups(setting, self.node_rank, self.root_device, self._timeout)
        self._compressor.register(self.model, weighted=self._train_loader_factory is not None, hosts=hosts)

    def balance_batches(self, train_loader_factory: Callable[[Any], Any]) -> None:
        """Let a load balancer build the training DataLoader and weight each rank's gradients.

        ``train_loader_factory(loader)`` receives the training DataLoader (with its DistributedSampler) and returns
        the one to use; every bucket is multiplied by :attr:`gradient_weight` before the all-reduce. Call it before
        the run is set up (a callback's ``setup``), as :class:`~ds_lightning.callbacks.DynamicLoadBalancer` does.

        Raises:
            ValueError: when the strategy runs the user's own ``ddp_comm_hook``, which the weighting would replace.

        """
        if self._fully_sharding:
            raise ValueError(
                "Balancing batches weights each rank's gradients in ds_mirrored's DDP comm hook, but"
                " sharding_engine='fsdp2' replaces DDP; use sharding_engine='zero' (with shard_parameters=False) or"
                " remove the DynamicLoadBalancer."
            )
        if self._ddp_comm_hook is not None:
            raise ValueError(
                f"Balancing batches weights each rank's gradients in ds_mirrored's comm hook, but"
                f" ddp_comm_hook={self._ddp_comm_hook!r} replaces it; remove ddp_comm_hook or the DynamicLoadBalancer."
            )
        self._train_loader_factory = train_loader_factory

    @property
    def gradient_weight(self) -> float:
        """This rank's gradient multiplier before averaging (``world_size * local_batch / global_batch``)."""
        return self._compressor.weight

    @gradient_weight.setter
    def gradient_weight(self, weight: float) -> None:
        self._compressor.weight = float(weight)

    @property
    def last_bucket_time(self) -> float:
        """``time.perf_counter()`` when this rank's last gradient bucket was launched (while balancing)."""
        return self._compressor.last_bucket_time

    @property
    def auto_compression(self) -> AutoState | None:
        """Under ``gradient_compression="auto"``, once set up: the current choice, its decisions and figures."""
        return self._compressor.auto

    @property
    def comm_bytes_per_step(self) -> float:
        """Payload bytes this rank hands to gradient all-reduce per step under the chosen compression."""
        return self._compressor.bytes_per_step

    @property
    def uncompressed_bytes_per_step(self) -> int:
        """Payload bytes of one uncompressed gradient all-reduce."""
        return self._compressor.uncompressed_bytes_per_step

    # --- data -----------------------------------------------------------------------------------------------------

    @override
    def _shape_train_loader(self, dataloader: Any) -> Any:
        return self._train_loader_factory(dataloader) if self._train_loader_factory is not None else dataloader

    @override
    def _shape_eval_loader(self, dataloader: Any) -> Any:
        unpadded = super()._shape_eval_loader(dataloader)
        counts = uneven_batch_counts(unpadded)
        if counts is None or not self._fully_sharding:
            return unpadded
        # FSDP2 gathers the parameters in every forward, a collective per batch: the ranks must run as many batches.
        rank_zero_warn(
            f"ds_mirrored(sharding_engine='fsdp2'): unpadded evaluation shards would run {counts} batches per rank, and"
            " a fully sharded forward is a collective; Lightning's padded shards are kept, so a few samples count"
            " twice. Pick a batch size that gives every rank as many batches to evaluate each sample once."
        )
        return dataloader

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        if self._fitting_now and (self._train_loader_factory is not None or self.data_cursor is not None):
            return dataloader  # equal step counts by construction
        # Evaluation and prediction deliberately give ranks uneven shards: a DDP forward without gradients runs no
        # collective per batch (FSDP2's does, and keeps equal counts: see _shape_eval_loader).
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        predicting = trainer is not None and trainer.state.fn == TrainerFn.PREDICTING
        if not self.even_batches or predicting or (not self._fitting_now and not self._fully_sharding):
            return dataloader
        return even_batches(dataloader, self.root_device)

    # --- optimizer-state sharding ----------------------------------------------------------------------------------

    @property
    @override
    def _fully_sharding(self) -> bool:
        return self.shard_optimizer_state and self.sharding_engine == "fsdp2"

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)  # under fsdp2, after fully_shard: over the sharded parameters
        if self.shard_optimizer_state and not self._fully_sharding:
            self.optimizers = shard_optimizers(self.optimizers, self.lr_scheduler_configs)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.state_dict_type == "sharded":
            return self.sharded_optimizer_state(optimizer)  # this rank's part: nothing consolidated on rank 0
        if self._sharded_now:
            return self._fully_sharded_optimizer_state(optimizer)
        if not self.shard_optimizer_state:
            return super().optimizer_state(optimizer)
        return consolidated_state(getattr(optimizer, "_optimizer", optimizer), writer=self.is_global_zero)

    @override
    def sharded_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if (module := self.lightning_module) is None or not self.shard_optimizer_state or self._fully_sharding:
            return super().sharded_optimizer_state(optimizer)  # DTensors (fsdp2) or replicated: the defaults
        return zero_partition_state(module, optimizer)

    @override
    def load_sharded_optimizer_states(self, sources: Sequence[SavedShards]) -> None:
        if (module := self.lightning_module) is None or not self.shard_optimizer_state or self._fully_sharding:
            return super().load_sharded_optimizer_states(sources)
        load_zero_partitions(module, self.optimizers, sources, self.sharded_checkpoint_group())

    # --- checkpoints ----------------------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self._compressor.method.checkpointed and dist.is_available() and dist.is_initialized():
            sharded = self.state_dict_type == "sharded"  # then each rank writes its own state: nothing is gathered
            add_compression_state(checkpoint, self._compressor, self.gradient_compression, sharded)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        sources = sharded_parts(checkpoint, "optimizer_states")  # a sharded folder: each rank reads its own part
        if sources is not None:
            self.load_sharded_optimizer_states(sources)
        elif self._sharded_now:
            self._load_fully_sharded_optimizer_states(checkpoint)
        elif self.shard_optimizer_state:
            load_sharded_states(self.optimizers, checkpoint["optimizer_states"])
        else:
            super().load_optimizer_state_dict(checkpoint)
        if self._compressor.method.checkpointed:
            group = self.sharded_checkpoint_group()
            load_compression_state(checkpoint, self._compressor, self.gradient_compression, group, self.root_device)

    # --- errors ---------------------------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if isinstance(exception, RuntimeError) and _COLLECTIVE_FAILURE.search(str(exception)):
            seconds = self._timeout.total_seconds() if self._timeout is not None else float("nan")
            log.error(
                "ds_mirrored: a collective failed on rank %d (timeout %.0f s): another rank stopped taking part, e.g."
                " it ran out of data (keep even_batches=True), raised an exception, was killed, lost its network link,"
                " or reached a collective (self.log(sync_dist=True), a barrier) that the others skipped. Raise"
                " `timeout` only if a step is genuinely that slow.",
                self.global_rank,
                seconds,
            )
