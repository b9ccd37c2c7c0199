"""The server channel: one gloo group of every worker and server, beside the workers' own process group.

The chief watches the servers it started while the group forms, so a server that dies during start-up fails the run
at once instead of after the whole timeout.
"""

from __future__ import annotations

import os
import subprocess
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ds_lightning.environments.tf_config import TFConfig
from ds_lightning.environments.torchelastic import store_round

_GENERATION = [0]  # fits with this strategy so far in this process; every process of a run counts alike


def own_host(tf: TFConfig | None, server_index: int | None) -> str:
    """The address this task listens on: its ``TF_CONFIG`` entry, or loopback without one."""
    if tf is None:
        return "127.0.0.1"
    if server_index is not None:
        return tf.cluster["ps"][server_index][0]
    return tf.cluster[tf.task_type][tf.task_index][0]


def store_address(tf: TFConfig | None) -> tuple[str, int]:
    """Where the rendezvous store of the workers' process group listens."""
    if tf is not None:
        return tf.main_address
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])


def connect_servers(
    tf: TFConfig | None,
    rank: int,
    size: int,
    server_index: int | None,
    timeout_seconds: float,
    servers: list[subprocess.Popen],
    host: str | None = None,
) -> Any:
    """Form the channel's gloo group; this process is ``rank`` of ``size`` (workers first, then servers).

    Args:
        tf: the cluster's ``TF_CONFIG``, or ``None`` on one machine.
        rank: this process's rank in the channel.
        size: workers plus servers.
        server_index: this server's index, ``None`` on a worker.
        timeout_seconds: how long forming the group (and any later wait on it) may take.
        servers: the server processes this process started and watches while the group forms.
        host: the address this process binds to; ``None``: its ``TF_CONFIG`` entry, or loopback without one.

    Raises:
        RuntimeError: when a watched server exits before the group formed.

    """
    _GENERATION[0] += 1
    address, port = store_address(tf)
    timeout = timedelta(seconds=timeout_seconds)
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, missing from torch's stubs
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host or own_host(tf, server_index))]
    # torchrun's shared store outlives a restart of the group: the restarted processes must not read the old keys.
    prefix = dist.PrefixStore(f"ds_parameter_server/{store_round()}/{_GENERATION[0]}/", store)
    if not servers:
        return dist.ProcessGroupGloo(prefix, rank, size, options)
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
    return made["pg"]


def connect_server_group(tf: TFConfig | None, server_index: int, num_servers: int, timeout_seconds: float) -> None:
    """Make the servers' own gloo group this server process's default one: sharded checkpoints are saved over it.

    Formed after the channel (:func:`connect_servers`, whose generation it shares), on the same rendezvous store. Only
    the servers take part, so ``torch.distributed.checkpoint`` coordinates their writes with no worker involved.
    """
    address, port = store_address(tf)
    timeout = timedelta(seconds=timeout_seconds)
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    prefix = dist.PrefixStore(f"ds_parameter_server/{store_round()}/{_GENERATION[0]}/servers/", store)
    dist.init_process_group("gloo", store=prefix, rank=server_index, world_size=num_servers, timeout=timeout)
