"""``ds_parameter_server``: workers pull parameters, compute gradients and push them to sharded parameter servers.

The engine lives in :mod:`ds_lightning.parameter_server`; this class wires it into Lightning's Strategy hooks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning.checkpoint.options import StateDictType
from ds_lightning.data.eval_shards import exact_mean_input
from ds_lightning.environments.parameter_server_roles import (
    SchedulerPart,
    scheduler_part,
    server_environment,
    tf_config_servers,
)
from ds_lightning.parameter_server.channel import connect_server_group, connect_servers
from ds_lightning.parameter_server.checkpoint import ConsolidatedRun, ResumePoint, starting_shards
from ds_lightning.parameter_server.chief_checkpoints import ChiefCheckpoints
from ds_lightning.parameter_server.client import ServerClient
from ds_lightning.parameter_server.collectives import LiveWorkerCollectives
from ds_lightning.parameter_server.launch import SERVER_ENV, ServerLauncher, WorkerLauncher
from ds_lightning.parameter_server.optimizer_shard import check_server_optimizer, check_trainable_model
from ds_lightning.parameter_server.options import (
    StalenessLR,
    check_no_validation_under_budget,
    check_options,
    gradient_compression_option,
)
from ds_lightning.parameter_server.server_process import serve_shard
from ds_lightning.parameter_server.sharding import ParameterShardPlan, plan_shards
from ds_lightning.parameter_server.worker_step import PushingOptimizer, WorkerStep, handle_sigterm_locally
from ds_lightning.strategies.base import ClusterStrategy, StartMethod
from ds_lightning.strategies.capabilities import StrategyCapabilities


class ParameterServerStrategy(ChiefCheckpoints, LiveWorkerCollectives, ClusterStrategy):
    """Asynchronous (or bounded-stale) data parallelism through parameter servers, like TF's ParameterServerStrategy.

    ``Trainer(strategy="ds_parameter_server", devices=N)`` trains on N worker processes and starts ``num_servers``
    CPU server processes beside them. Each server owns a size-balanced shard of the trainable parameters and runs the
    optimizer from ``configure_optimizers`` (and its LR schedulers) on it. Workers pull parameters, run the user's
    ``training_step`` and backward, and push gradients. Under ``TF_CONFIG``, ``ps`` tasks serve and ``chief``/``worker``
    tasks train; every task runs the same command. Under torchrun, its last ``num_servers`` ranks serve and the others
    train (see :mod:`ds_lightning.environments.parameter_server_roles`).

    The arguments ``DDPStrategy`` takes come first, in its positions (see
    :class:`~ds_lightning.strategies.ClusterStrategy`); the ones about torch's DDP wrapper are refused, since workers
    never all-reduce gradients, and there is no ``**kwargs`` for torch's DDP. The parameter-server options are
    keyword-only.

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
        process_group_backend: the workers' own group (``sync_dist``, barriers); the server channel is always gloo.
        timeout: how long any wait may take (process groups, server replies) before it fails: seconds or a
            ``timedelta``; ``None`` means torch's default (30 minutes).
        start_method: only ``"popen"``: the chief starts the servers beside the workers.
        num_servers: server processes (default 1); under ``TF_CONFIG`` the number of ``ps`` tasks; under torchrun
            how many of its last ranks serve.
        max_staleness: ``None`` fully asynchronous; ``k >= 1`` stale synchronous (no worker more than ``k`` pushes
            ahead of the slowest live one); ``0`` bulk synchronous (one averaged update per step from every worker,
            the numerics of ``ds_mirrored``).
        staleness_lr: ``"inverse"`` divides the learning rate of a gradient that is ``s`` updates stale by ``s``.
        push_every: average this many steps' gradients locally before one push (parameters are pulled after it).
        gradient_compression: how pushes travel (the option ``ds_mirrored`` takes too): ``"none"``, ``"fp16"``,
            ``"bf16"`` or ``"topk"`` (with error feedback); all-reduce methods (``"powersgd"``, ``"auto"``) are refused.
        topk_ratio: fraction of entries ``"topk"`` sends.
        max_updates: a global budget: stop every worker once the servers applied this many updates (fast workers do
            more of them). ``None``: each worker runs its own ``max_epochs``/``max_steps``.
        min_shard_bytes: a parameter is split across servers only into pieces of at least this size.
        compression: deprecated name of ``gradient_compression`` (warns with a ``DeprecationWarning``).
        state_dict_type: ``"full"`` (one file) or ``"sharded"`` (a folder in Lightning FSDP's layout, written by
            the chief alone with ``torch.distributed.checkpoint``: parameters and optimizer state keyed by name, so
            it resumes on another number of servers; the servers' state is still gathered by the chief).

    Raises:
        ValueError: for an invalid option, naming the value and the fix.

    """

    strategy_name = "ds_parameter_server"
    serves_parameters = True
    capabilities = StrategyCapabilities(
        agrees_over_default_group=False, saves_from_chief_alone=True, steps_optimizer_on_servers=True
    )

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
        num_servers: int | None = None,
        max_staleness: int | None = None,
        staleness_lr: StalenessLR = "none",
        push_every: int = 1,
        gradient_compression: str = "none",
        topk_ratio: float = 0.01,
        max_updates: int | None = None,
        min_shard_bytes: int = 256 * 1024,
        compression: str | None = None,
        state_dict_type: StateDictType = "full",
    ) -> None:
        push = gradient_compression_option(gradient_compression, compression)
        check_options(
            num_servers, max_staleness, staleness_lr, push_every, push, topk_ratio, max_updates, min_shard_bytes
        )
        if start_method != "popen":
            raise ValueError(
                f"ParameterServerStrategy got start_method={start_method!r}, but the chief starts the servers as new"
                " processes beside the workers; remove start_method (it must be 'popen')."
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
            state_dict_type=state_dict_type,
        )
        self._refuse_ddp_options("ds_parameter_server does not wrap the model in torch's DDP (workers push to servers)")
        self._num_servers_arg = num_servers
        self.num_servers = num_servers or 1
        self.max_staleness = max_staleness
        self.staleness_lr = staleness_lr
        self.push_every = push_every
        self.gradient_compression = push
        self.topk_ratio = float(topk_ratio)
        self.max_updates = max_updates
        self.min_shard_bytes = min_shard_bytes
        assert self._timeout is not None  # ClusterStrategy puts torch's default in place of None
        self.timeout_seconds = self._timeout.total_seconds()
        self._server_index: int | None = None
        self.fitting = False  # whether this Trainer call is fit; the launcher sets it
        self._training = False
        self._pg: Any = None
        self._plan: ParameterShardPlan | None = None
        self._client: ServerClient | None = None
        self._step: WorkerStep | None = None
        self._params: dict[str, Tensor] = {}
        self._finished = False
        self._resume: ResumePoint | None = None
        self._final_state: ConsolidatedRun | None = None
        self._reset_survivors()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if "ds_parameter_server" not in strategy_registry:
            strategy_registry.register(
                "ds_parameter_server", cls, description="ds_lightning parameter-server training (async, SSP or BSP)"
            )

    # --- roles and ranks ------------------------------------------------------------------------------------------

    @property
    def is_server(self) -> bool:
        """Whether this process serves parameters instead of training."""
        return self._server_index is not None

    @property
    def num_workers(self) -> int:
        """Training processes: ``devices`` per chief/worker task, or torchrun's (SLURM's) ranks that do not serve."""
        env = self.cluster_environment
        return env.num_workers if isinstance(env, SchedulerPart) else self.num_nodes * self.num_processes

    @property
    def starts_local_servers(self) -> bool:
        """Whether the chief starts the servers on this machine (no ``TF_CONFIG``)."""
        return self.tf_config is None and self.fitting

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_workers, "rank": self.global_rank}

    @override
    def set_world_ranks(self) -> None:
        # Once split (Lightning calls this again in setup_distributed), the scheduler's node count is already adopted.
        part = self.cluster_environment if isinstance(self.cluster_environment, SchedulerPart) else None
        config = None if part is not None else self.adopt_cluster()
        part = part or scheduler_part(self.cluster_environment, self.num_servers)
        if part is not None:
            self.cluster_environment, self._server_index = part, part.server_index
            DDPStrategy.set_world_ranks(self)  # the part keeps the scheduler's rank; its world is the workers'
            return
        if config is not None:
            self.num_servers, self._server_index = tf_config_servers(config, self._num_servers_arg)
        elif self._num_nodes > 1:
            raise ValueError(
                f"ds_parameter_server on num_nodes={self._num_nodes} needs TF_CONFIG to say where the servers run;"
                " start every task with its TF_CONFIG (see examples/tf_config/), or train on one node."
            )
        elif os.environ.get(SERVER_ENV) is not None:
            self._server_index = int(os.environ[SERVER_ENV])
        if self._server_index is not None:
            self.cluster_environment = server_environment(self.num_workers, self._server_index)
            # Servers never log. Lightning documents setting this attribute, which its decorator's overloads lack.
            rank_zero_only.rank = self.num_workers + self._server_index  # type: ignore[attr-defined]
            return
        DDPStrategy.set_world_ranks(self)  # TF_CONFIG is adopted above

    @override
    def _configure_launcher(self) -> None:
        self._launcher = ServerLauncher(self) if self.is_server else WorkerLauncher(self)

    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu") if self.is_server else super().root_device

    # --- early checks and the server channel ----------------------------------------------------------------------

    def check_model(self, trainer: Any) -> None:
        """Refuse a model the servers cannot train, before any process starts (see ``check_trainable_model``)."""
        check_trainable_model(trainer)

    def _connect_servers(self) -> None:
        rank = self.num_workers + self._server_index if self.is_server else self.global_rank  # type: ignore[operator]
        launcher = self._launcher
        servers = launcher.servers if isinstance(launcher, WorkerLauncher) else []
        size = self.num_workers + self.num_servers
        env = self.cluster_environment
        host = env.channel_host() if isinstance(env, SchedulerPart) else None
        self._pg = connect_servers(self.tf_config, rank, size, self._server_index, self.timeout_seconds, servers, host)

    @override
    def setup_environment(self) -> None:
        if self._server_index is not None:  # a server
            self._connect_servers()
            if self.state_dict_type == "sharded" and self.num_servers > 1:  # the servers write their parts together
                connect_server_group(self.tf_config, self._server_index, self.num_servers, self.timeout_seconds)
            return
        super().setup_environment()
        if self.fitting:
            self._connect_servers()

    # --- setup ----------------------------------------------------------------------------------------------------

    def _trainable(self) -> dict[str, Tensor]:
        assert self.lightning_module is not None
        return {n: p for n, p in self.lightning_module.named_parameters() if p.requires_grad}

    def _make_plan(self) -> ParameterShardPlan:
        return plan_shards(self._trainable(), self.num_servers, min_shard_bytes=self.min_shard_bytes)

    @override
    def setup(self, trainer: Any) -> None:
        self._reset_survivors()
        if self.is_server:
            self._serve(trainer)
        Strategy.setup(self, trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            assert self.model is not None
            self._broadcast_module_state(self.model)  # evaluate rank 0's parameters everywhere, as DDP does
            return
        check_server_optimizer(self.optimizers, self.lr_scheduler_configs, self.lightning_module.automatic_optimization)
        # The servers step the schedulers; the workers' copies would only warn that their optimizer never steps.
        self.lr_scheduler_configs = []
        self._plan = self._make_plan()
        self._params = self._trainable()
        check_no_validation_under_budget(self.max_updates, trainer)
        if self.max_updates is not None:
            self._keep_metrics_local()
        else:
            self._route_metric_syncs()
        handle_sigterm_locally(trainer)
        addresses = [f"{h}:{p}" for h, p in self.tf_config.cluster["ps"]] if self.tf_config else None
        client_args = (self._pg, self.global_rank, self.num_workers, self._plan)
        self._client = ServerClient(*client_args, self.gradient_compression, self.topk_ratio, addresses)
        self._step = WorkerStep(self._client, self._params, self.push_every)
        self._finished, self._final_state = False, None
        if self.is_global_zero:
            sizes = [f"{b / 2**20:.2f} MiB" for b in self._plan.bytes_per_server()]
            rank_zero_info(
                f"ds_parameter_server: {self.num_workers} worker(s), {self.num_servers} server(s) holding {sizes};"
                f" max_staleness={self.max_staleness}, gradient_compression={self.gradient_compression},"
                f" push_every={self.push_every}"
            )

    @override
    def _setup_model(self, model: Any) -> Any:
        return model  # no DDP wrapper: gradients go to the servers, never all-reduced between workers

    def _serve(self, trainer: Any) -> None:
        assert self.lightning_module is not None and self._server_index is not None
        self.setup_optimizers(trainer)
        check_server_optimizer(self.optimizers, self.lr_scheduler_configs, self.lightning_module.automatic_optimization)
        serve_shard(
            self._pg,
            self._server_index,
            self.num_workers,
            self.optimizers[0],
            self.lr_scheduler_configs,
            self._trainable(),
            self._make_plan(),
            max_staleness=self.max_staleness,
            staleness_lr=self.staleness_lr,
            max_updates=self.max_updates,
            timeout=self.timeout_seconds,
            fail_on_lost_worker=getattr(self.cluster_environment, "restarts_whole_group", False),
        )

    # --- training step: pull, compute, push -----------------------------------------------------------------------

    def _trainer(self) -> Any:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        step = self._step
        if self._client is None or step is None:
            return super().training_step(*args, **kwargs)
        trainer = self._trainer()
        if step.pull_due:
            result = step.pull(trainer, self.optimizers[0])
            self._note_gone(result.gone)
            if result.stop:
                # The global update budget is spent. Lightning forbids skipping a step under DDP-style strategies,
                # so this one runs, pushes nothing, and is the last.
                trainer.should_stop = True
                step.budget_spent = True
        output = super().training_step(*args, **kwargs)
        step.log(trainer, self.lightning_module)
        return output

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        step = self._step
        if self._client is None or step is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        # The precision plugin still runs the closure, the callbacks and gradient clipping; only step() changes.
        pushing = PushingOptimizer(optimizer, lambda loss: step.push(loss, self._trainer()))
        return self.precision_plugin.optimizer_step(pushing, model, closure, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # LiveWorkerCollectives.reduce comes first and does not call on: the base's eval-step check goes here.
        self._refuse_uneven_step_collective("a reduce (e.g. self.log(..., on_step=True, sync_dist=True))")
        return super().reduce(exact_mean_input(tensor, reduce_op), group=group, reduce_op=reduce_op)

    def _ask_who_is_gone(self) -> list[int] | None:
        if self._client is None or self._finished:
            return None
        return self._client.status()

    # --- start and end of fit -------------------------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._training = self._client is not None
        if self._client is None or not self.is_global_zero:
            return
        assert self._plan is not None
        resume, epoch = self._resume or ResumePoint(), self._trainer().current_epoch
        self._client.init(starting_shards(self._plan, self._params, resume, self._index_of(), epoch))
        self._resume = None

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._training = False
        if self._client is None or self._finished:
            return
        trainer = self._trainer()
        # Answered once every worker finished: each ends fit with the final parameters, the chief with the state too.
        _, states = self._client.done(
            self._params, step=trainer.global_step, epoch=trainer.current_epoch, with_state=self.is_global_zero
        )
        if self.is_global_zero:
            self._final_state = self._consolidated_state(states)
        self._finished = True

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._step is not None and not self._finished and not self._trainer().sanity_checking:
            self._step.peek()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self._step is not None:
            self._step.unpeek()

    @override
    def teardown(self) -> None:
        self._unroute_metric_syncs()
        super().teardown()
        self._client, self._step = None, None
        if self._pg is not None:
            # Closing our connections tells the servers this worker is gone, also when fit() raised before "done".
            with contextlib.suppress(Exception):
                self._pg.abort()
            self._pg = None
        launcher = self._launcher
        if isinstance(launcher, WorkerLauncher) and launcher.servers and self.fitting:
            launcher.reap_servers(self.timeout_seconds)
            launcher.servers = []
