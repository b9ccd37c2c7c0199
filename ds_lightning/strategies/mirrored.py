"""``ds_mirrored``: synchronous data parallelism, one full replica per device, on Lightning's DDP and torch DDP."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ds_lightning.comm.compression import COMPRESSIONS, CompressionName, GradientCompressor
from ds_lightning.strategies._cluster import (
    StartMethod,
    adopt_tf_config,
    check_launch_options,
    destroy_process_group_at_exit,
    pin_interfaces,
)
from ds_lightning.strategies._even_batches import even_batches
from ds_lightning.strategies._registration import register_start_methods
from ds_lightning.strategies._rendezvous import setup_distributed

log = logging.getLogger(__name__)

__all__ = ["MirroredStrategy"]

_CHECKPOINT_KEY = "ds_mirrored"
_COLLECTIVE_FAILURE = re.compile(r"timed? ?out|timeout|pair closure|connection closed|connection reset", re.IGNORECASE)


def _positive(name: str, value: float, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a number > 0, e.g. MirroredStrategy({name}={example}).")


class MirroredStrategy(DDPStrategy):
    """Synchronous data parallelism: every device holds a full replica and gradients are averaged every step.

    The counterpart of ``tf.distribute.MirroredStrategy`` / ``MultiWorkerMirroredStrategy``, built on Lightning's
    :class:`~lightning.pytorch.strategies.DDPStrategy` and torch's ``DistributedDataParallel`` (NCCL on CUDA, gloo on
    CPU). With ``TF_CONFIG`` set, each chief/worker task becomes one node of the run.

    Args:
        gradient_compression: how gradients cross the wire: ``"none"`` (DDP's all-reduce), ``"fp16"`` or ``"bf16"``
            (half-width all-reduce) or ``"powersgd"`` (low-rank PowerSGD with error feedback, checkpointed).
        powersgd_rank: PowerSGD's approximation rank; higher is more accurate and sends more bytes.
        powersgd_start_iter: plain all-reduce steps before PowerSGD starts.
        bucket_cap_mb: DDP gradient bucket size in MiB.
        static_graph: tell DDP the set of used parameters never changes (enables extra optimisations).
        find_unused_parameters: let DDP detect parameters that receive no gradient in a step.
        gradient_as_bucket_view: let gradients live inside DDP's communication buckets, saving a copy per step and
            the memory of a second gradient buffer (do not ``detach_()`` gradients in place when it is on).
        timeout: seconds any collective may wait before the run fails instead of hanging.
        start_method: ``"popen"`` re-runs the script per rank (like ``ddp``); ``"spawn"``/``"fork"``/``"forkserver"``
            use multiprocessing (like ``ddp_spawn``).
        even_batches: give every rank the same number of batches (capping to the shortest rank) so uneven inputs cannot
            hang gradient synchronisation.
        process_group_backend: ``"gloo"``, ``"nccl"``, ... ; ``None`` picks NCCL for CUDA and gloo otherwise.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer, or :class:`~ds_lightning.environments.TFConfigEnvironment`.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.

    Raises:
        ValueError: for any out-of-range option, naming the value and the fix.

    """

    strategy_name = "ds_mirrored"

    def __init__(
        self,
        gradient_compression: CompressionName = "none",
        powersgd_rank: int = 2,
        powersgd_start_iter: int = 10,
        bucket_cap_mb: float = 25.0,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        timeout: float = 1800.0,
        start_method: StartMethod = "popen",
        even_batches: bool = True,
        process_group_backend: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if gradient_compression not in COMPRESSIONS:
            raise ValueError(
                f"gradient_compression={gradient_compression!r} is not supported; choose one of {list(COMPRESSIONS)}."
            )
        _positive("bucket_cap_mb", bucket_cap_mb, "25")
        check_launch_options("MirroredStrategy", timeout, start_method, process_group_backend)
        flags = (
            ("static_graph", static_graph),
            ("find_unused_parameters", find_unused_parameters),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("even_batches", even_batches),
        )
        for flag_name, flag in flags:
            if not isinstance(flag, bool):
                raise ValueError(f"{flag_name}={flag!r} must be True or False.")
        self._compressor = GradientCompressor(
            gradient_compression, powersgd_rank=powersgd_rank, powersgd_start_iter=powersgd_start_iter
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout),
            start_method=start_method,
            bucket_cap_mb=bucket_cap_mb,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        self.gradient_compression = gradient_compression
        self.even_batches = even_batches
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

    # --- cluster: TF_CONFIG ---------------------------------------------------------------------------------------

    @override
    def setup_distributed(self) -> None:
        setup_distributed(self)  # rank 0's rendezvous store listens on the main address only

    @override
    def setup_environment(self) -> None:
        pin_interfaces(self.cluster_environment)
        super().setup_environment()
        destroy_process_group_at_exit(self._get_process_group_backend())

    @override
    def set_world_ranks(self) -> None:
        self.cluster_environment, self._num_nodes = adopt_tf_config(
            "ds_mirrored", self.cluster_environment, self._num_nodes
        )
        super().set_world_ranks()

    # --- DDP wrapping and compression -----------------------------------------------------------------------------

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only; ours must work on gloo too.
        assert isinstance(self.model, DistributedDataParallel)
        self._compressor.register(self.model, weighted=self._train_loader_factory is not None)

    def balance_batches(self, train_loader_factory: Callable[[Any], Any]) -> None:
        """Let a load balancer build the training DataLoader and weight each rank's gradients.

        ``train_loader_factory(loader)`` receives the training DataLoader (with its DistributedSampler) and returns
        the one to use; every bucket is multiplied by :attr:`gradient_weight` before the all-reduce. Call it before
        the run is set up (a callback's ``setup``), as :class:`~ds_lightning.callbacks.DynamicLoadBalancer` does.
        """
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
    def comm_bytes_per_step(self) -> float:
        """Payload bytes this rank hands to gradient all-reduce per step under the chosen compression."""
        return self._compressor.bytes_per_step

    @property
    def uncompressed_bytes_per_step(self) -> int:
        """Payload bytes of one uncompressed gradient all-reduce."""
        return self._compressor.uncompressed_bytes_per_step

    # --- data -----------------------------------------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if self._train_loader_factory is not None and trainer is not None and trainer.training:
            return self._train_loader_factory(dataloader)  # equal step counts by construction
        # Prediction deliberately gives ranks uneven shards and runs no collectives per batch.
        if not self.even_batches or (trainer is not None and trainer.state.fn == TrainerFn.PREDICTING):
            return dataloader
        return even_batches(dataloader, self.root_device)

    # --- checkpoints ----------------------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.gradient_compression == "powersgd" and dist.is_available() and dist.is_initialized():
            # Error feedback differs per rank: gather every rank's state into the one consolidated file.
            states: list[Any] = [None] * self.world_size
            dist.all_gather_object(states, self._compressor.state_dict())
            checkpoint[_CHECKPOINT_KEY] = {
                "gradient_compression": self.gradient_compression,
                "world_size": self.world_size,
                "compression_states": states,
            }
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.gradient_compression != "powersgd":
            return
        saved = checkpoint.get(_CHECKPOINT_KEY)
        if saved is None or saved.get("gradient_compression") != "powersgd":
            rank_zero_warn("The checkpoint holds no PowerSGD state; error feedback starts from zero.")
            return
        if saved["world_size"] != self.world_size:
            rank_zero_warn(
                f"The checkpoint's PowerSGD state is for {saved['world_size']} ranks, this run has {self.world_size};"
                " error feedback starts from zero."
            )
            return
        self._compressor.load_state_dict(saved["compression_states"][self.global_rank], device=self.root_device)

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
