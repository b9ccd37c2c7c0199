"""How ``ds_parameter_server`` processes start: workers as Lightning starts DDP ranks, servers beside them.

Under torchrun (or any launcher that creates the processes) the launcher starts nothing: torchrun started them all.
"""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

SERVER_ENV = "DS_PS_SERVER"
_STARTED_ENV = "DS_PS_SERVERS_STARTED"


class LaunchedStrategy(Protocol):
    """What the launchers need of the strategy (``ParameterServerStrategy``), without importing it."""

    cluster_environment: ClusterEnvironment | None
    fitting: bool
    num_servers: int

    @property
    def num_processes(self) -> int:
        """Workers on this node."""
        ...

    @property
    def num_nodes(self) -> int:
        """Training tasks."""
        ...

    @property
    def starts_local_servers(self) -> bool:
        """Whether the chief starts the servers on this machine."""
        ...

    def check_model(self, trainer: pl.Trainer) -> None:
        """Refuse a model the servers cannot train."""
        ...


class _ServingFinished(Exception):
    """Raised by a server's ``setup`` once it has served, to leave ``Trainer.fit`` without training."""


class WorkerLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher for the workers, plus the local server processes.

    Unlike DDP, no observer kills every process when one child fails: a lost worker must not stop the others, and a
    lost server makes every worker raise by itself.
    """

    def __init__(self, strategy: LaunchedStrategy) -> None:
        assert strategy.cluster_environment is not None
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self._strategy = strategy
        self.servers: list[subprocess.Popen] = []

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self._strategy.fitting = fitting
        if fitting and trainer is not None:
            self._strategy.check_model(trainer)  # before any process starts
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            if self._strategy.starts_local_servers and not os.environ.get(_STARTED_ENV):
                self._start_servers()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def _start_servers(self) -> None:
        os.environ[_STARTED_ENV] = "1"  # one set of servers per script; they follow its fit() calls themselves
        for index in range(self._strategy.num_servers):
            env = os.environ.copy()
            env.pop("LOCAL_RANK", None)
            env[SERVER_ENV] = str(index)
            env.setdefault("OMP_NUM_THREADS", "1")
            self.servers.append(subprocess.Popen(_basic_subprocess_cmd(), env=env))

    def reap_servers(self, timeout: float) -> None:
        """Wait for the local servers to exit; kill any still running after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for proc in self.servers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("parameter server process %d did not exit within %.0f s; killing it", proc.pid, timeout)
                proc.kill()
                proc.wait()

    @override
    def kill(self, signum: Any) -> None:
        super().kill(signum)
        for proc in self.servers:
            proc.send_signal(signum)


class ServerLauncher(_Launcher):
    """Runs a server process's ``fit`` up to the strategy's ``setup``, where it serves, and returns nothing."""

    def __init__(self, strategy: LaunchedStrategy) -> None:
        self._strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return None  # servers exist only while workers fit; the workers validate, test and predict
        self._strategy.fitting = True
        _set_num_threads_if_needed(num_processes=1)
        bound = inspect.signature(function).bind(*args, **kwargs)
        if "ckpt_path" in bound.arguments:
            bound.arguments["ckpt_path"] = None  # the chief sends the checkpoint's state; it may be on another host
        try:
            function(*bound.args, **bound.kwargs)
        except _ServingFinished:
            # Done, and torn down. Leave now: letting the interpreter finalise gloo's threads aborted the process
            # ("terminate called without an active exception") in about half the runs, and the rest of the user's
            # script (after fit) is the workers' to run, not a server's.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        raise RuntimeError("a parameter server left Trainer.fit without serving; this is a ds_lightning bug.")

    @override
    def kill(self, signum: Any) -> None:
        return None
