"""``ds_parameter_server``: workers pull parameters, compute gradients and push them to sharded parameter servers."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning.environments._interfaces import pin_socket_interfaces
from ds_lightning.environments.tf_config import TFConfig, TFConfigEnvironment, TFConfigError
from ds_lightning.ps.client import PullResult, ServerClient
from ds_lightning.ps.optimizer_shard import (
    ShardOptimizer,
    check_server_optimizer,
    consolidate_state,
    split_full_state,
)
from ds_lightning.ps.push_compression import PUSH_COMPRESSIONS, PushCompressionName
from ds_lightning.ps.server import ParameterServer, SchedulerSlot, _jsonable
from ds_lightning.ps.sharding import ShardPlan, plan_shards
from ds_lightning.strategies._cluster import check_launch_options, destroy_process_group_at_exit
from ds_lightning.strategies._ps_launchers import SERVER_ENV, ServerLauncher, ServingFinished, WorkerLauncher
from ds_lightning.strategies._rendezvous import setup_distributed

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "ds_parameter_server"
StalenessLR = Literal["none", "inverse"]
_GENERATION = [0]  # fits with this strategy so far in this process; every process of a run counts alike


def _check_optional_int(name: str, value: object, minimum: int, fix: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: {fix}")


class ParameterServerStrategy(DDPStrategy):
    """Asynchronous (or bounded-stale) data parallelism through parameter servers, like TF's ParameterServerStrategy.

    ``Trainer(strategy="ds_parameter_server", devices=N)`` trains on N worker processes and starts ``num_servers``
    CPU server processes beside them. Each server owns a size-balanced shard of the trainable parameters and runs the
    optimizer from ``configure_optimizers`` (and its LR schedulers) on it. Workers pull parameters, run the user's
    ``training_step`` and backward, and push gradients. Under ``TF_CONFIG``, ``ps`` tasks serve and ``chief``/``worker``
    tasks train; every task runs the same command.

    Args:
        num_servers: server processes (default 1); under ``TF_CONFIG`` the number of ``ps`` tasks.
        max_staleness: ``None`` fully asynchronous; ``k >= 1`` stale synchronous (no worker more than ``k`` pushes
            ahead of the slowest live one); ``0`` bulk synchronous (one averaged update per step from every worker,
            the numerics of ``ds_mirrored``).
        staleness_lr: ``"inverse"`` divides the learning rate of a gradient that is ``s`` updates stale by ``s``.
        push_every: average this many steps' gradients locally before one push (parameters are pulled after it).
        compression: ``"none"``, ``"fp16"``, ``"bf16"`` or ``"topk"`` (with error feedback) for pushes.
        topk_ratio: fraction of entries ``"topk"`` sends.
        max_updates: a global budget: stop every worker once the servers applied this many updates (fast workers do
            more of them). ``None``: each worker runs its own ``max_epochs``/``max_steps``.
        min_shard_bytes: a parameter is split across servers only into pieces of at least this size.
        timeout: seconds any wait may take (process groups, server replies) before it fails.
        process_group_backend: the workers' own group (``sync_dist``, barriers); the server channel is always gloo.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer, or :class:`~ds_lightning.environments.TFConfigEnvironment`.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.

    """

    strategy_name = "ds_parameter_server"

    def __init__(
        self,
        num_servers: int | None = None,
        max_staleness: int | None = None,
        staleness_lr: StalenessLR = "none",
        push_every: int = 1,
        compression: PushCompressionName = "none",
        topk_ratio: float = 0.01,
        max_updates: int | None = None,
        min_shard_bytes: int = 256 * 1024,
        timeout: float = 1800.0,
        process_group_backend: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        _check_optional_int("num_servers", num_servers, 1, "start at least one server, e.g. num_servers=1.")
        _check_optional_int(
            "max_staleness",
            max_staleness,
            0,
            "use None (asynchronous), 0 (bulk synchronous) or k >= 1 (stale synchronous), e.g. max_staleness=4.",
        )
        if staleness_lr not in ("none", "inverse"):
            raise ValueError(f"staleness_lr={staleness_lr!r} is unknown; use 'none' or 'inverse'.")
        _check_optional_int("push_every", push_every, 1, "push at least every step, e.g. push_every=1.")
        if push_every is None:
            raise ValueError("push_every=None is invalid: pass an integer >= 1, e.g. push_every=1.")
        if compression not in PUSH_COMPRESSIONS:
            raise ValueError(f"compression={compression!r} is unknown; choose one of {list(PUSH_COMPRESSIONS)}.")
        if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float)) or not 0 < topk_ratio <= 1:
            raise ValueError(f"topk_ratio={topk_ratio!r} must be in (0, 1], e.g. topk_ratio=0.01.")
        _check_optional_int("max_updates", max_updates, 1, "use None or a positive number of server updates.")
        _check_optional_int("min_shard_bytes", min_shard_bytes, 1, "use a positive size, e.g. 262144.")
        check_launch_options("ParameterServerStrategy", timeout, "popen", process_group_backend)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout),
            start_method="popen",
        )
        self._num_servers_arg = num_servers
        self.num_servers = num_servers or 1
        self.max_staleness = max_staleness
        self.staleness_lr = staleness_lr
        self.push_every = push_every
        self.compression = compression
        self.topk_ratio = float(topk_ratio)
        self.max_updates = max_updates
        self.min_shard_bytes = min_shard_bytes
        self.timeout_seconds = float(timeout)
        self._tf: TFConfig | None = None
        self._server_index: int | None = None
        self._fitting = False
        self._pg: Any = None
        self._plan: ShardPlan | None = None
        self._client: ServerClient | None = None
        self._params: dict[str, Tensor] = {}
        self._pull_due = True
        self._basis = 0
        self._accumulated: dict[str, Tensor] | None = None
        self._accumulated_steps = 0
        self._last_pull: PullResult | None = None
        self._logged_bytes = (0, 0)
        self._gone: set[int] = set()
        self._groups: dict[frozenset[int], Any] = {}
        self._finished = False
        self._eval_backup: dict[str, Tensor] | None = None
        self._resume: dict[str, Any] | None = None
        self._final_state: dict[str, Any] | None = None
        self._budget_spent = False
        self._training = False

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
        """Training processes in the run: ``devices`` per chief/worker task."""
        return self.num_nodes * self.num_processes

    @property
    def starts_local_servers(self) -> bool:
        """Whether the chief starts the servers on this machine (no ``TF_CONFIG``)."""
        return self._tf is None and self._fitting

    def _read_tf_config(self) -> TFConfig | None:
        env = self.cluster_environment
        if isinstance(env, TFConfigEnvironment):
            return env.config
        if (env is None or type(env) is LightningEnvironment) and TFConfigEnvironment.detect():
            return TFConfig.from_json(os.environ["TF_CONFIG"])
        return None

    @override
    def set_world_ranks(self) -> None:
        self._tf = self._read_tf_config()
        if self._tf is not None:
            self._adopt_tf_config(self._tf)
        elif self._num_nodes > 1:
            raise ValueError(
                f"ds_parameter_server on num_nodes={self._num_nodes} needs TF_CONFIG to say where the servers run;"
                " start every task with its TF_CONFIG (see examples/tf_config/), or train on one node."
            )
        elif os.environ.get(SERVER_ENV) is not None:
            self._server_index = int(os.environ[SERVER_ENV])
        if self._server_index is not None:
            env = LightningEnvironment()
            env.set_world_size(self.num_workers)
            env.set_global_rank(self.num_workers + self._server_index)
            self.cluster_environment = env
            rank_zero_only.rank = self.num_workers + self._server_index  # servers never log
            return
        super().set_world_ranks()

    def _adopt_tf_config(self, config: TFConfig) -> None:
        servers = len(config.cluster.get("ps", []))
        if servers == 0:
            raise TFConfigError(
                "TF_CONFIG has no `cluster.ps` job, so ds_parameter_server has no parameter servers; list at least one"
                ' ps task, e.g. "ps": ["10.0.0.3:2222"], and start it with the same ds-train command.'
            )
        if config.task_type == "evaluator":
            raise TFConfigError(
                "TF_CONFIG field `task.type` is 'evaluator', which ds_parameter_server does not run; evaluate with"
                " `ds-train validate` outside the cluster instead."
            )
        if self._num_servers_arg not in (None, servers):
            raise TFConfigError(
                f"num_servers={self._num_servers_arg} but TF_CONFIG lists {servers} ps task(s); leave num_servers"
                " unset under TF_CONFIG, or make the cluster spec match."
            )
        self.num_servers = servers
        tasks = config.num_training_tasks
        if self._num_nodes not in (1, tasks):
            raise TFConfigError(
                f"TF_CONFIG lists {tasks} training task(s) (chief + workers) but Trainer(num_nodes={self._num_nodes});"
                f" use num_nodes={tasks} or leave it at its default."
            )
        self._num_nodes = tasks
        if config.task_type == "ps":
            self._server_index = config.task_index
        elif not isinstance(self.cluster_environment, TFConfigEnvironment):
            self.cluster_environment = TFConfigEnvironment()

    @override
    def _configure_launcher(self) -> None:
        self._launcher = ServerLauncher(self) if self.is_server else WorkerLauncher(self)

    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu") if self.is_server else super().root_device

    # --- early checks ---------------------------------------------------------------------------------------------

    def check_model(self, trainer: Any) -> None:
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

    # --- process groups -------------------------------------------------------------------------------------------

    def _own_host(self) -> str:
        if self._tf is None:
            return "127.0.0.1"
        if self.is_server:
            return self._tf.cluster["ps"][self._server_index][0]  # type: ignore[index]
        return self._tf.cluster[self._tf.task_type][self._tf.task_index][0]

    def _store_address(self) -> tuple[str, int]:
        if self._tf is not None:
            return self._tf.main_address
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])

    def _connect_servers(self) -> None:
        _GENERATION[0] += 1
        host, port = self._store_address()
        timeout = timedelta(seconds=self.timeout_seconds)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._own_host())]
        rank = self.num_workers + self._server_index if self.is_server else self.global_rank  # type: ignore[operator]
        prefix = dist.PrefixStore(f"ds_parameter_server/{_GENERATION[0]}/", store)
        size = self.num_workers + self.num_servers
        launcher = self._launcher
        servers = launcher.servers if isinstance(launcher, WorkerLauncher) else []
        if not servers:
            self._pg = dist.ProcessGroupGloo(prefix, rank, size, options)
            return
        # The chief watches the servers it started: one that dies during start-up must not leave the workers
        # waiting for the whole timeout.
        made: dict[str, Any] = {}

        def connect() -> None:
            try:
                made["pg"] = dist.ProcessGroupGloo(prefix, rank, size, options)
            except BaseException as error:
                made["error"] = error

        thread = threading.Thread(target=connect, daemon=True, name="ps-connect")
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            for index, proc in enumerate(servers):
                if thread.is_alive() and proc.poll() is not None:
                    raise RuntimeError(
                        f"parameter server {index} (pid {proc.pid}) exited with code {proc.returncode} before it"
                        " connected; its error is printed above. Servers run your script up to trainer.fit, so that"
                        " part must work in a process whose trainer.global_rank is the number of workers or more."
                    )
        if "error" in made:
            raise made["error"]
        self._pg = made["pg"]

    @override
    def setup_distributed(self) -> None:
        # Rank 0's rendezvous store listens on the main address only; servers on other hosts must reach it too.
        hosts = {host for tasks in self._tf.cluster.values() for host, _ in tasks} if self._tf is not None else set()
        setup_distributed(self, spans_hosts=len(hosts) > 1)

    @override
    def setup_environment(self) -> None:
        if self.is_server:
            self._connect_servers()
            return
        if self._tf is not None:
            pin_socket_interfaces(self._own_host())
        super().setup_environment()
        destroy_process_group_at_exit(self._get_process_group_backend())
        if self._fitting:
            self._connect_servers()

    # --- setup ----------------------------------------------------------------------------------------------------

    def _trainable(self) -> dict[str, Tensor]:
        assert self.lightning_module is not None
        return {n: p for n, p in self.lightning_module.named_parameters() if p.requires_grad}

    def _make_plan(self) -> ShardPlan:
        return plan_shards(self._trainable(), self.num_servers, min_shard_bytes=self.min_shard_bytes)

    @override
    def setup(self, trainer: Any) -> None:
        if self.is_server:
            self._serve(trainer)
        Strategy.setup(self, trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            from lightning.fabric.utilities.distributed import _sync_module_states

            _sync_module_states(self.model)  # evaluate rank 0's parameters everywhere, as DDP does
            return
        check_server_optimizer(self.optimizers, self.lr_scheduler_configs, self.lightning_module.automatic_optimization)
        # The servers step the schedulers; the workers' copies would only warn that their optimizer never steps.
        self.lr_scheduler_configs = []
        self._plan = self._make_plan()
        self._params = self._trainable()
        if (
            self.max_updates is not None
            and trainer.limit_val_batches != 0
            and trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined()
        ):
            raise ValueError(
                f"ds_parameter_server(max_updates={self.max_updates}) stops workers at different epochs, so validation"
                " during fit would pair up different epochs across workers. Set Trainer(limit_val_batches=0) and"
                " run trainer.validate(...) after fit, or bound the run with max_epochs/max_steps instead."
            )
        if self.max_updates is not None:
            self._keep_metrics_local()
        else:
            self._route_metric_syncs()
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            # Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training step, a per-step collective that
            # would hold every worker to the slowest one. Each worker handles its own SIGTERM instead.
            epoch_loop._broadcast_sigterm_tensor = partial(_raise_on_local_sigterm, trainer)
        addresses = [f"{h}:{p}" for h, p in self._tf.cluster["ps"]] if self._tf else None
        self._client = ServerClient(
            self._pg, self.global_rank, self.num_workers, self._plan, self.compression, self.topk_ratio, addresses
        )
        self._pull_due, self._finished, self._gone, self._final_state = True, False, set(), None
        self._budget_spent = False
        if self.is_global_zero:
            sizes = [f"{b / 2**20:.2f} MiB" for b in self._plan.bytes_per_server()]
            rank_zero_info(
                f"ds_parameter_server: {self.num_workers} worker(s), {self.num_servers} server(s) holding {sizes};"
                f" max_staleness={self.max_staleness}, compression={self.compression}, push_every={self.push_every}"
            )

    def _route_metric_syncs(self) -> None:
        """Route torchmetrics' state gathering, which spans the whole world, through the live workers only.

        Otherwise a metric's ``compute()`` after a worker was lost waits on the lost one and fails the chief.
        """
        from torchmetrics import Metric

        assert self.lightning_module is not None
        gather = _LiveWorkersGather(self)
        for module in self.lightning_module.modules():
            if isinstance(module, Metric) and module.dist_sync_fn is None and module.process_group is None:
                module.dist_sync_fn = gather  # a user's own sync function or group is left alone

    def _unroute_metric_syncs(self) -> None:
        if self.lightning_module is None:
            return
        for module in self.lightning_module.modules():
            if isinstance(getattr(module, "dist_sync_fn", None), _LiveWorkersGather):
                module.dist_sync_fn = None

    def _keep_metrics_local(self) -> None:
        """Under an update budget workers end at different epochs; torchmetrics would all-gather across them."""
        from torchmetrics import Metric

        assert self.lightning_module is not None
        synced = [
            name for name, m in self.lightning_module.named_modules() if isinstance(m, Metric) and m.sync_on_compute
        ]
        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.sync_on_compute = False
                module.dist_sync_on_step = False
        if synced:
            rank_zero_info(
                f"ds_parameter_server(max_updates={self.max_updates}): metrics {synced} are computed per worker"
                " (sync_on_compute=False), since workers stop at different epochs; the chief logs its own."
            )

    @override
    def _setup_model(self, model: Any) -> Any:
        return model  # no DDP wrapper: gradients go to the servers, never all-reduced between workers

    def _serve(self, trainer: Any) -> None:
        assert self.lightning_module is not None and self._server_index is not None
        self.setup_optimizers(trainer)
        check_server_optimizer(self.optimizers, self.lr_scheduler_configs, self.lightning_module.automatic_optimization)
        plan = self._make_plan()
        shard = ShardOptimizer(self.optimizers[0], self._trainable(), plan, self._server_index)
        slots = [SchedulerSlot(c.scheduler, c.interval, c.frequency) for c in self.lr_scheduler_configs]
        server = ParameterServer(
            self._pg,
            self._server_index,
            self.num_workers,
            shard,
            slots,
            self.max_staleness,
            self.staleness_lr,
            self.max_updates,
            self.timeout_seconds,
        )
        print(
            f"[ds_lightning] parameter server {self._server_index} serving {plan.server_numel(self._server_index)}"
            f" parameters to {self.num_workers} worker(s)",
            file=sys.stderr,
            flush=True,
        )
        report = server.serve()
        print(
            f"[ds_lightning] parameter server {self._server_index} done: {report.updates} updates in"
            f" {report.seconds:.1f} s; workers finished {report.finished}, lost {report.lost}",
            file=sys.stderr,
            flush=True,
        )
        if not report.finished:
            raise RuntimeError(
                f"parameter server {self._server_index}: every worker was lost ({report.lost}) before finishing;"
                " see the workers' errors."
            )
        raise ServingFinished

    # --- training step: pull, compute, push -----------------------------------------------------------------------

    def _trainer(self) -> Any:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    def _pull(self) -> PullResult:
        assert self._client is not None
        trainer = self._trainer()
        result = self._client.pull(self._params, step=trainer.global_step, epoch=trainer.current_epoch)
        self._basis, self._pull_due, self._last_pull = result.version, False, result
        self._note_gone(result.gone)
        for group, lr in zip(self.optimizers[0].param_groups, result.lrs, strict=False):
            group["lr"] = lr  # what LearningRateMonitor shows is the servers' learning rate
        return result

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._client is None:
            return super().training_step(*args, **kwargs)
        if self._pull_due and self._pull().stop:
            # The global update budget is spent. Lightning forbids skipping a step under DDP-style strategies, so
            # this one runs, pushes nothing, and is the last.
            self._trainer().should_stop = True
            self._budget_spent = True
        output = super().training_step(*args, **kwargs)
        self._log_step()
        return output

    def _log_step(self) -> None:
        """Log this step's traffic and staleness on the steps Lightning's loggers write (self.log costs ~1 ms)."""
        assert self._client is not None and self.lightning_module is not None
        pushed, pulled = self._client.bytes_pushed, self._client.bytes_pulled
        values = {  # one step's traffic: the previous push and this pull
            "ps/bytes_pushed": float(pushed - self._logged_bytes[0]),
            "ps/bytes_pulled": float(pulled - self._logged_bytes[1]),
        }
        self._logged_bytes = (pushed, pulled)
        trainer = self._trainer()
        every = trainer.log_every_n_steps
        if not every or (trainer.global_step + 1) % every:
            return
        if self._last_pull is not None:
            values["ps/staleness_step_mean"] = self._last_pull.staleness_mean
            values["ps/staleness_step_max"] = self._last_pull.staleness_max
            values["ps/server_updates"] = float(self._last_pull.updates)
            values.update(self._last_pull.stats)
        self.lightning_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._client is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        # The precision plugin still runs the closure, the callbacks and gradient clipping; only step() changes.
        return self.precision_plugin.optimizer_step(_PushingOptimizer(optimizer, self._push), model, closure, **kwargs)

    def _push(self, loss: Any) -> None:
        assert self._client is not None
        if loss is None or self._budget_spent:
            return
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self._params.items()}
        if self.push_every > 1:
            if self._accumulated is None:
                self._accumulated = {n: g.detach().clone() for n, g in grads.items()}
            else:
                for name, grad in grads.items():
                    self._accumulated[name] += grad
            self._accumulated_steps += 1
            if self._accumulated_steps < self.push_every:
                return
            grads = {n: g / self._accumulated_steps for n, g in self._accumulated.items()}
            self._accumulated, self._accumulated_steps = None, 0
        trainer = self._trainer()
        self._client.push(grads, basis=self._basis, step=trainer.global_step, epoch=trainer.current_epoch)
        self._pull_due = True

    # --- start and end of fit -------------------------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._training = self._client is not None
        if self._client is None or not self.is_global_zero:
            return
        assert self._plan is not None
        trainer = self._trainer()
        index_of = self._index_of()
        resume = self._resume or {}
        full_state = resume.get("optimizer_state")
        shard_states = [
            split_full_state(self._plan, s, full_state, index_of) if full_state else ([], [])
            for s in range(self.num_servers)
        ]
        saved = resume.get("progress") or {}
        extra = {
            "updates": int(saved.get("updates", resume.get("global_step", 0))),
            "epoch": trainer.current_epoch,
            "param_groups": [
                _jsonable({k: v for k, v in g.items() if k != "params"}) for g in full_state["param_groups"]
            ]
            if full_state
            else [],
            "schedulers": _jsonable(resume.get("lr_schedulers", [])),
        }
        self._client.init(self._params, shard_states, extra)
        self._resume = None

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._training = False
        if self._client is None or self._finished:
            return
        if self.is_global_zero:
            self._final_state = self._consolidated_state()
        trainer = self._trainer()
        self._client.done(self._params, step=trainer.global_step, epoch=trainer.current_epoch)
        self._finished = True

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._client is not None and not self._finished and not self._trainer().sanity_checking:
            self._eval_backup = {n: p.detach().clone() for n, p in self._params.items()}
            self._client.pull(self._params, op="peek")  # evaluate the newest parameters

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self._eval_backup is not None:
            with torch.no_grad():
                for name, saved in self._eval_backup.items():
                    self._params[name].copy_(saved)  # the next gradient is computed on the pulled basis
            self._eval_backup = None

    @override
    def teardown(self) -> None:
        self._unroute_metric_syncs()
        super().teardown()
        self._client = None
        if self._pg is not None:
            # Closing our connections tells the servers this worker is gone, also when fit() raised before "done".
            with contextlib.suppress(Exception):
                self._pg.abort()
            self._pg = None
        launcher = self._launcher
        if isinstance(launcher, WorkerLauncher) and launcher.servers and self._fitting:
            launcher.reap_servers(self.timeout_seconds)
            launcher.servers = []

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def _index_of(self) -> dict[str, int]:
        assert self.lightning_module is not None
        name_of = {id(p): n for n, p in self.lightning_module.named_parameters()}
        params = [p for group in self.optimizers[0].param_groups for p in group["params"]]
        return {name_of[id(p)]: i for i, p in enumerate(params)}

    def _consolidated_state(self) -> dict[str, Any]:
        assert self._client is not None and self._plan is not None
        replies = self._client.state()
        params = {n: p.detach().clone() for n, p in self._params.items()}
        shards = []
        for server, (header, tensors) in enumerate(replies):
            self._plan.unflatten_into(tensors[0], server, params)
            shards.append((header["state_entries"], tensors[1 : 1 + int(header["n_state"])]))
        first = replies[0][0]
        groups = self.optimizers[0].state_dict()["param_groups"]
        for group, hyper in zip(groups, first["param_groups"], strict=True):
            group.update(hyper)
        shapes = {n: p.shape for n, p in self._params.items()}
        optimizer_state = consolidate_state(self._plan, shards, shapes, self._index_of(), groups)
        progress = {k: first[k] for k in ("updates", "version", "epoch", "clocks", "worker_progress", "lost")}
        progress.update(num_servers=self.num_servers, num_workers=self.num_workers, max_staleness=self.max_staleness)
        return {
            "params": params,
            "optimizer_state": optimizer_state,
            "lr_schedulers": first["schedulers"],
            "progress": progress,
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.is_global_zero and (self._client is not None or self._final_state is not None):
            state = self._final_state if self._finished else self._consolidated_state()
            if state is not None:
                for name in state["params"]:
                    # after fit the module already holds the final parameters; mid-fit the servers hold the newest
                    checkpoint["state_dict"][name] = (
                        self._params[name].detach().clone() if self._finished else state["params"][name]
                    )
                checkpoint["optimizer_states"] = [state["optimizer_state"]]
                checkpoint["lr_schedulers"] = state["lr_schedulers"]
                checkpoint[CHECKPOINT_KEY] = state["progress"]
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # The servers hold the optimizer; the chief hands them this state when training starts.
        states = checkpoint.get("optimizer_states") or []
        self._resume = {
            "optimizer_state": states[0] if states else None,
            "lr_schedulers": checkpoint.get("lr_schedulers", []),
            "progress": checkpoint.get(CHECKPOINT_KEY),
            "global_step": checkpoint.get("global_step", 0),
        }

    # --- collectives among the live workers -----------------------------------------------------------------------

    def _note_gone(self, gone: list[int]) -> None:
        new = set(gone) - self._gone
        if new:
            log.info("ds_parameter_server: worker(s) %s left (finished or lost); collectives go on without them", new)
            self._gone |= new

    def _survivors(self) -> tuple[int, ...]:
        return tuple(w for w in range(self.num_workers) if w not in self._gone)

    def _collective(self, run: Callable[[Any], Any], alone: Callable[[], Any]) -> Any:
        """Run ``run(group)`` over the live workers, learning of lost ones from the servers when it fails."""
        if self.is_server or not (dist.is_available() and dist.is_initialized()):
            return alone()
        for attempt in range(2):
            survivors = self._survivors()
            if len(survivors) == 1:
                return alone()
            if len(survivors) == self.num_workers:
                group = None
            else:
                key = frozenset(survivors)
                if key not in self._groups:
                    self._groups[key] = dist.new_group(
                        list(survivors), timeout=timedelta(seconds=self.timeout_seconds), use_local_synchronization=True
                    )
                group = self._groups[key]
            try:
                return run(group)
            except RuntimeError:
                if attempt or self._client is None or self._finished:
                    raise
                before = set(self._gone)
                self._note_gone(self._client.status())
                if self._gone == before:
                    raise
        raise AssertionError("unreachable")

    @property
    def _independent(self) -> bool:
        # Under an update budget workers stop at different epochs, so epoch-level collectives cannot pair up.
        return self.max_updates is not None and self._training

    def _refuse_sync(self, what: str) -> None:
        raise RuntimeError(
            f"ds_parameter_server(max_updates={self.max_updates}) cannot {what}: with an update budget the workers"
            " stop at different epochs, so their collectives would not pair up. Log without sync_dist=True, or drop"
            " max_updates and bound the run with max_epochs/max_steps."
        )

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._independent:
            return  # only the chief writes checkpoints; nobody needs to wait for it
        self._collective(lambda group: dist.barrier(group=group), lambda: None)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._independent:
            return decision
        return super().reduce_boolean_decision(decision, all=all)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._independent:
            return obj

        def run(group: Any) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src, group=group)
            return box[0]

        return self._collective(run, lambda: obj)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        if group is not None:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        if self._independent:
            self._refuse_sync("reduce across workers (self.log(..., sync_dist=True))")
        return self._collective(lambda g: _sync_ddp_if_available(tensor, g, reduce_op=reduce_op), lambda: tensor)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if group is not None:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        if self._independent:
            self._refuse_sync("all_gather across workers")
        return self._collective(
            lambda g: super(ParameterServerStrategy, self).all_gather(tensor, group=g, sync_grads=sync_grads),
            lambda: tensor.unsqueeze(0),
        )


class _LiveWorkersGather:
    """A torchmetrics ``dist_sync_fn``: ``gather_all_tensors`` over the strategy's live workers.

    Holds the strategy weakly and pickles to a plain gather, so a model stays picklable and outlives its Trainer.
    """

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        self._strategy: Callable[[], ParameterServerStrategy | None] = weakref.ref(strategy)

    def __call__(self, tensor: Tensor, group: Any | None = None) -> list[Tensor]:
        from torchmetrics.utilities.distributed import gather_all_tensors

        strategy = self._strategy()
        if group is not None or strategy is None:
            return gather_all_tensors(tensor, group=group)
        return strategy._collective(lambda g: gather_all_tensors(tensor, group=g), lambda: [tensor])

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._strategy = lambda: None


def _raise_on_local_sigterm(trainer: Any) -> None:
    if getattr(trainer, "received_sigterm", False):
        raise SIGTERMException()


class _PushingOptimizer:
    """Stands in for the worker's optimizer inside Lightning's precision plugin: ``step`` pushes instead of updating."""

    def __init__(self, optimizer: Optimizer, push: Callable[[Any], None]) -> None:
        self._optimizer = optimizer
        self._push = push

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is None:
            # The precision plugin ran the closure itself (AMP's scaler does, then steps only on finite gradients).
            self._push(True)
            return None
        loss = closure()
        self._push(loss)  # a closure that returned None (training_step skipped the batch) pushes nothing
        return loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
