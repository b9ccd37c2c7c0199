"""``ClusterStrategy``: the one base of the multi-process ds strategies, a drop-in for Lightning's ``DDPStrategy``.

It owns what every such strategy shares: the launch options (validated, ``timeout`` as seconds or a ``timedelta``),
``TF_CONFIG`` adoption, rank 0's rendezvous store bound to the main address, pinning gloo/NCCL to the task's own
interface, a user's own DDP comm hook on every backend, and destroying a gloo process group at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import KubeflowEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.distributed import _destroy_dist_connection, _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.checkpoint.options import StateDictType, check_state_dict_type
from ds_lightning.checkpoint.strategy_hooks import ShardedCheckpoints
from ds_lightning.data.eval_shards import exact_mean_input, uneven_batch_counts, unpadded_eval_loader
from ds_lightning.data.resumable import DataCursor, position_loader
from ds_lightning.diagnostics.hang_verdict import HangVerdict
from ds_lightning.diagnostics.hang_watch import HangWatch, watch_strategy
from ds_lightning.environments._interfaces import pin_interfaces_toward_main, pin_socket_interfaces
from ds_lightning.environments.kubeflow import adopt_pytorchjob
from ds_lightning.environments.rendezvous import rendezvous_store
from ds_lightning.environments.tf_config import TFConfig
from ds_lightning.environments.tf_config_adoption import adopt_tf_config, tf_config_in_use
from ds_lightning.environments.torchelastic import AGENT_STORE_ENV, elastic_num_nodes, store_round
from ds_lightning.strategies.capabilities import LIGHTNING_DEFAULTS, StrategyCapabilities

__all__ = ["BACKENDS", "ClusterStrategy", "StartMethod"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("gloo", "nccl", "mpi", "ucc")
_EXIT_HOOK_REGISTERED = False


def check_launch_options(
    strategy: str, timeout: object, start_method: object, process_group_backend: object
) -> timedelta:
    """Validate the launch options every multi-process strategy takes, naming the bad value and the fix.

    Returns:
        ``timeout`` as a ``timedelta`` (``None`` means torch's default, 30 minutes).

    Raises:
        ValueError: for a non-positive timeout, an unknown start method or an unknown backend.

    """
    duration = check.seconds("timeout", timeout, f"{strategy}(timeout=600)") if timeout is not None else None
    check.choice("start_method", start_method, START_METHODS)
    if process_group_backend is not None:
        check.choice(
            "process_group_backend", process_group_backend, BACKENDS, "or None to pick NCCL on CUDA and gloo otherwise"
        )
    return duration if duration is not None else default_pg_timeout


def destroy_process_group_at_exit(backend: str) -> None:
    """Destroy a non-NCCL default process group at interpreter exit.

    Lightning does this for NCCL only; a gloo group left alive at exit can abort the process ("terminate called
    without an active exception") after training has succeeded.
    """
    global _EXIT_HOOK_REGISTERED
    if not _EXIT_HOOK_REGISTERED and backend != "nccl":
        atexit.register(_destroy_dist_connection)
        _EXIT_HOOK_REGISTERED = True


def setup_distributed(strategy: DDPStrategy, spans_hosts: bool = False) -> None:
    """``DDPStrategy.setup_distributed`` with rank 0's rendezvous store listening on the main address only.

    ``spans_hosts`` says that tasks outside this process group (parameter servers) connect from other hosts; a run
    of several nodes spans hosts anyway. Under torchrun (``TORCHELASTIC_USE_AGENT_STORE``) the agent already hosts the
    store, so torch's own rendezvous runs.
    """
    reset_seed()
    strategy.set_world_ranks()
    strategy._process_group_backend = strategy._get_process_group_backend()
    env = strategy.cluster_environment
    assert env is not None
    kwargs: dict[str, Any] = {"timeout": strategy._timeout}
    if strategy.root_device.type != "cpu":
        kwargs["device_id"] = strategy.root_device
    if not dist.is_initialized() and os.environ.get(AGENT_STORE_ENV) != "True":
        kwargs["store"] = rendezvous_store(
            env.main_address,
            env.main_port,
            env.global_rank(),
            env.world_size(),
            strategy._timeout or default_pg_timeout,
            spans_hosts=spans_hosts or strategy.num_nodes > 1,
        )
    _init_dist_connection(env, strategy._process_group_backend, **kwargs)


class ClusterStrategy(ShardedCheckpoints, DDPStrategy):
    """Lightning's ``DDPStrategy`` with ds_lightning's cluster set-up; the base of the multi-process ds strategies.

    Takes every argument ``DDPStrategy`` takes, in the same positions, and forwards extra keyword arguments to torch's
    ``DistributedDataParallel`` as ``DDPStrategy`` does. On top of it:

    - ``timeout`` is validated and may be a number of seconds or a ``timedelta``;
    - with ``TF_CONFIG`` set (and no more specific environment chosen) each chief/worker task becomes one node, and a
      cluster the strategy cannot run is refused with :class:`~ds_lightning.environments.TFConfigError`; a subclass
      that sets :attr:`serves_parameters` accepts ``ps`` tasks (and requires a ``ps`` job) instead;
    - rank 0's rendezvous store listens on the main address only (see :mod:`ds_lightning.environments.rendezvous`);
    - under ``TF_CONFIG`` gloo and NCCL use the interface holding the task's own address;
    - ``ddp_comm_hook`` (optionally wrapped by ``ddp_comm_wrapper``) is registered on every backend, not on CUDA only;
    - a gloo process group is destroyed at exit (Lightning does this for NCCL only);
    - ``state_dict_type="sharded"`` writes checkpoints as folders every rank writes its own part of, with
      ``torch.distributed.checkpoint``, in Lightning FSDP's layout (see :mod:`ds_lightning.checkpoint`); a sharded
      folder is loaded with either setting.

    Args:
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer, or :class:`~ds_lightning.environments.TFConfigEnvironment`.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        ddp_comm_state: state passed to ``ddp_comm_hook`` (e.g. torch's ``PowerSGDState``).
        ddp_comm_hook: a torch DDP communication hook ``hook(state, bucket) -> Future``.
        ddp_comm_wrapper: wraps ``ddp_comm_hook`` (e.g. torch's ``fp16_compress_wrapper``); needs ``ddp_comm_hook``.
        model_averaging_period: steps between model averages under torch's post-local SGD hook.
        process_group_backend: ``"gloo"``, ``"nccl"``, ``"mpi"`` or ``"ucc"``; ``None`` picks NCCL on CUDA, else gloo.
        timeout: how long any collective may wait before the run fails instead of hanging: seconds (a number) or a
            ``timedelta``; ``None`` means torch's default (30 minutes).
        start_method: ``"popen"`` re-runs the script per rank (like ``ddp``); ``"spawn"``/``"fork"``/``"forkserver"``
            use multiprocessing (like ``ddp_spawn``).
        state_dict_type: ``"full"`` (one checkpoint file, gathered on rank 0) or ``"sharded"`` (a folder: every rank
            writes its part with ``torch.distributed.checkpoint``, nothing is gathered; ``python -m
            lightning.pytorch.utilities.consolidate_checkpoint <folder>`` makes one file of it), as Lightning's
            ``FSDPStrategy`` spells it. Keyword-only.
        **kwargs: passed on to torch's ``DistributedDataParallel``, e.g. ``broadcast_buffers=False``.

    Raises:
        ValueError: for an invalid option, naming the value and the fix.

    """

    #: The name each subclass registers under (``ds_mirrored``, ...), also used in its error messages.
    strategy_name: ClassVar[str]
    #: Whether ``TF_CONFIG`` ``ps`` tasks belong to this strategy (the parameter server sets it).
    serves_parameters: ClassVar[bool] = False
    #: What callbacks may ask of this strategy (see :mod:`ds_lightning.strategies.capabilities`); a subclass
    #: overrides only what differs from Lightning's own strategies.
    capabilities: ClassVar[StrategyCapabilities] = LIGHTNING_DEFAULTS

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
        state_dict_type: StateDictType = "full",
        **kwargs: Any,
    ) -> None:
        duration = check_launch_options(type(self).__name__, timeout, start_method, process_group_backend)
        self.state_dict_type = check_state_dict_type(state_dict_type, type(self).__name__)
        check.optional_integer(
            "model_averaging_period", model_averaging_period, 1, f"{type(self).__name__}(model_averaging_period=4)"
        )
        if ddp_comm_wrapper is not None and ddp_comm_hook is None:
            raise ValueError(
                f"ddp_comm_wrapper={ddp_comm_wrapper!r} wraps ddp_comm_hook, which is None; pass ddp_comm_hook too"
                " (e.g. torch's default_hooks.allreduce_hook) or drop ddp_comm_wrapper."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=duration,
            start_method=start_method,
            **kwargs,
        )
        self._tf_config: TFConfig | None = None
        self._hang_watch: HangWatch | None = None
        #: Set by :class:`~ds_lightning.callbacks.BackupAndRestore`: where a restored run's training data goes on.
        self.data_cursor: DataCursor | None = None
        self._in_eval_step = False

    def _refuse_ddp_options(self, why: str) -> None:
        """For a subclass that does not wrap the model in torch's DDP: refuse the options that would be ignored.

        Raises:
            ValueError: naming the first DDP option set and ``why`` it has no effect.

        """
        given = {
            "ddp_comm_state": self._ddp_comm_state,
            "ddp_comm_hook": self._ddp_comm_hook,
            "ddp_comm_wrapper": self._ddp_comm_wrapper,
            "model_averaging_period": self._model_averaging_period,
            **self._ddp_kwargs,
        }
        for name, value in given.items():
            if name in self._ddp_kwargs or value is not None:
                raise ValueError(f"{type(self).__name__} got {name}={value!r}, but {why}; remove {name}.")

    # --- TF_CONFIG ------------------------------------------------------------------------------------------------

    @property
    def tf_config(self) -> TFConfig | None:
        """The ``TF_CONFIG`` this run adopted, once ranks are set (``None`` without one)."""
        return self._tf_config

    def adopt_cluster(self) -> TFConfig | None:
        """Adopt ``TF_CONFIG``: set the environment and ``num_nodes`` from it after checking that it fits.

        Under torchrun, ``num_nodes`` is taken from its current round instead (see
        :mod:`ds_lightning.environments.torchelastic`). Called by :meth:`set_world_ranks`; safe to call again. A
        subclass with more to check (the number of servers) calls this first and reads the result.

        Returns:
            The adopted config, or ``None`` when the run does not use ``TF_CONFIG``.

        Raises:
            TFConfigError: see :func:`~ds_lightning.environments.tf_config_adoption.check_tf_config`.

        """
        self._tf_config = tf_config_in_use(self.cluster_environment)
        self.cluster_environment, self._num_nodes = adopt_tf_config(
            self.strategy_name, self.cluster_environment, self._num_nodes, self.serves_parameters
        )
        self.cluster_environment, self._num_nodes = adopt_pytorchjob(
            self.strategy_name, self.cluster_environment, self._num_nodes, self.num_processes
        )
        # Under torchrun the rendezvous round decides the node count (elastic: it may shrink or grow on a restart).
        nodes = elastic_num_nodes(self.cluster_environment, self.num_processes)
        if nodes is not None:
            self._num_nodes = nodes
        return self._tf_config

    @override
    def set_world_ranks(self) -> None:
        self.adopt_cluster()
        super().set_world_ranks()

    @property
    def own_host(self) -> str | None:
        """This task's host in ``TF_CONFIG`` (``None`` without one), the address gloo and NCCL bind to."""
        config = self._tf_config or tf_config_in_use(self.cluster_environment)
        return config.own_address[0] if config is not None else None

    @property
    def spans_hosts(self) -> bool:
        """Whether the run's processes live on several hosts: several nodes, or ``TF_CONFIG`` tasks on several."""
        config = self._tf_config
        hosts = {host for tasks in config.cluster.values() for host, _ in tasks} if config is not None else set()
        return self.num_nodes > 1 or len(hosts) > 1

    # --- data -----------------------------------------------------------------------------------------------------

    @property
    def _fitting_now(self) -> bool:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.training

    def _shape_train_loader(self, dataloader: Any) -> Any:
        """A subclass's own change to the training loader, made before it is positioned for a restore."""
        return dataloader

    def _shape_eval_loader(self, dataloader: Any) -> Any:
        """Validation and test shards without ``DistributedSampler``'s repeats: each sample is evaluated once."""
        kwargs = self.distributed_sampler_kwargs
        return unpadded_eval_loader(dataloader, kwargs["num_replicas"], kwargs["rank"], self.strategy_name)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        training = self._fitting_now
        dataloader = self._shape_train_loader(dataloader) if training else self._shape_eval_loader(dataloader)
        return position_loader(self, dataloader, self.data_cursor, training)

    # --- collectives inside an evaluation step --------------------------------------------------------------------

    @contextlib.contextmanager
    def _eval_step(self) -> Iterator[None]:
        """Mark a validation or test step, in which a collective must not meet ranks that have run out of batches."""
        self._in_eval_step = True
        try:
            yield
        finally:
            self._in_eval_step = False

    def _refuse_uneven_step_collective(self, what: str) -> None:
        """Refuse ``what`` (a collective) inside an evaluation step when the ranks run different numbers of batches.

        Decided on every rank from the shard sizes alone, so all ranks raise at the first such collective together
        instead of the ranks with more batches waiting for one that has finished.

        Raises:
            RuntimeError: naming the batch counts and what to change.

        """
        trainer = self.lightning_module._trainer if self._in_eval_step and self.lightning_module is not None else None
        if trainer is None:
            return
        loaders = trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders
        limit = trainer.limit_test_batches if trainer.testing else trainer.limit_val_batches
        steps = trainer.num_sanity_val_steps if trainer.sanity_checking else limit
        cap = steps if isinstance(steps, int) else None  # a float: a fraction of the batches, or inf for all of them
        if isinstance(loaders, dict):
            loaders = list(loaders.values())
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            counts = uneven_batch_counts(loader, cap)
            if counts is not None:
                raise RuntimeError(
                    f"{self.strategy_name} evaluates every sample once, so its ranks run {counts} batches; {what}"
                    " inside a validation/test step would wait for a rank that has finished. Log with"
                    " self.log(..., on_step=False, on_epoch=True, sync_dist=True) (reduced once at the epoch end, and"
                    " exact), or sync_dist=False for per-step values, or sync in on_validation_epoch_end."
                )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_step():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_step():
            return super().test_step(*args, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        self._refuse_uneven_step_collective("a reduce (e.g. self.log(..., on_step=True, sync_dist=True))")
        return super().reduce(exact_mean_input(tensor, reduce_op), group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        self._refuse_uneven_step_collective("self.all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # --- process group --------------------------------------------------------------------------------------------

    @override
    def setup_distributed(self) -> None:
        setup_distributed(self, spans_hosts=self.spans_hosts)
        self._watch_collectives()

    def _watch_collectives(self) -> None:
        """Watch this rank's collectives for one that waits too long (see :mod:`ds_lightning.diagnostics`)."""
        if self._hang_watch is None:
            self._hang_watch = watch_strategy(self, prefix=f"ds_lightning/hang/{store_round()}/")

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self._hang_watch is not None:
            # The verdict goes into the backend's error (every rank that raises prints it) and the dump folder.
            verdict = self._diagnose(self._hang_watch, exception)
            if verdict is not None:
                exception.add_note(verdict.message())

    def _diagnose(self, watch: HangWatch, exception: BaseException) -> HangVerdict | None:
        """The verdict on a failed collective, or on a peer outside the group that stopped answering.

        An error naming a ``lost_peer`` (rank, name), such as a parameter server lost to a worker, is judged as that
        peer's silence: it cannot answer, and the group's other ranks are not part of the call.
        """
        peer = getattr(exception, "lost_peer", None)
        if peer is not None:
            return watch.lost_peer(*peer)
        return watch.diagnose(exception, list(range(self.world_size)))

    @override
    def teardown(self) -> None:
        if self._hang_watch is not None:
            self._hang_watch.stop()
            self._hang_watch = None
        super().teardown()

    @override
    def setup_environment(self) -> None:
        host, env = self.own_host, self.cluster_environment
        if host is not None:
            pin_socket_interfaces(host)
        elif isinstance(env, (TorchElasticEnvironment, KubeflowEnvironment, SLURMEnvironment)):
            # Launches that name no address of this task, only the main one (SLURM's first node).
            pin_interfaces_toward_main(env.main_address, env.main_port)
        super().setup_environment()
        destroy_process_group_at_exit(self._get_process_group_backend())

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers a comm hook on CUDA only; gloo runs them too.
        if self._ddp_comm_hook is None:
            return
        assert isinstance(self.model, DistributedDataParallel)
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(state=self._ddp_comm_state, hook=hook)
