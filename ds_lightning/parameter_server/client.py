"""A worker's side of the parameter-server protocol (see :mod:`ds_lightning.parameter_server.server_loop`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ds_lightning.parameter_server.checkpoint import ShardState
from ds_lightning.parameter_server.push_compression import PushCompressor
from ds_lightning.parameter_server.server_loop import REPLY_TAG, REQUEST_TAG
from ds_lightning.parameter_server.sharding import ParameterShardPlan
from ds_lightning.parameter_server.tensor_messages import (
    Pending,
    channel_capacity,
    post_message,
    recv_message,
    send_message,
)


class ServerLostError(RuntimeError):
    """A parameter server stopped answering: it died, or it hung past the timeout.

    ``server`` is its index, ``rank`` its rank in the channel of workers and servers.
    """

    server: int | None = None
    rank: int | None = None

    @property
    def lost_peer(self) -> tuple[int, str] | None:
        """The rank that stopped answering and its name, for the hang verdict (``None`` when unknown)."""
        return None if self.rank is None else (self.rank, f"parameter server {self.server}")


@dataclass
class PullResult:
    """What the servers said with the parameters."""

    version: int = 0
    updates: int = 0
    stop: bool = False
    lost: list[int] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    lrs: list[float] = field(default_factory=list)
    clocks: list[int] = field(default_factory=list)


class ServerClient:
    """Talks to every server for one worker.

    Args:
        pg: the gloo group of workers and servers.
        worker: this worker's rank (and index).
        num_workers: the number of workers; server ``s`` has rank ``num_workers + s``.
        plan: the shard plan.
        compression: the push compression (``gradient_compression``), a method that serves pushes.
        topk_ratio: the fraction top-k sends.
        addresses: how to name each server in errors (host of its task).

    """

    def __init__(
        self,
        pg: Any,
        worker: int,
        num_workers: int,
        plan: ParameterShardPlan,
        compression: str = "none",
        topk_ratio: float = 0.01,
        addresses: list[str] | None = None,
    ) -> None:
        self.pg = pg
        self.worker = worker
        self.num_workers = num_workers
        self.plan = plan
        self.compression = compression
        self.compressors = [PushCompressor(compression, topk_ratio) for _ in range(plan.num_servers)]
        self.addresses = addresses or ["127.0.0.1"] * plan.num_servers
        self.bytes_pushed = 0
        self._pending = [Pending([], []) for _ in range(plan.num_servers)]
        self.bytes_pulled = 0
        self._capacity = [channel_capacity(4 * plan.server_numel(s)) for s in range(plan.num_servers)]  # fp32 shards
        self._buffers = [torch.empty(c, dtype=torch.uint8) for c in self._capacity]
        # The pull that rode on the last push: False (none), True (asked, answer not yet read) or the answer read.
        self._next_pull: list[bool | tuple[dict[str, Any], list[Tensor], int]] = [False] * plan.num_servers

    def _rank(self, server: int) -> int:
        return self.num_workers + server

    def _lost(self, server: int, doing: str, error: BaseException) -> ServerLostError:
        text = str(error).split(". This is typically")[0]
        first = text.splitlines()[0][:300] if text else type(error).__name__
        lost = ServerLostError(
            f"Lost parameter server {server} (ps task {server} at {self.addresses[server]}, process-group rank"
            f" {self._rank(server)}) while worker {self.worker} was {doing}: {first}. The server process died or"
            " hung past the strategy's timeout; resume from the last checkpoint with ckpt_path=..."
        )
        lost.server, lost.rank = server, self._rank(server)
        return lost

    def _send(self, server: int, header: dict[str, Any], tensors: list[Tensor], doing: str, wait: bool = True) -> int:
        try:
            self._pending[server].wait()
            if wait:
                return send_message(self.pg, self._rank(server), REQUEST_TAG, header, tensors, self._capacity[server])
            nbytes, self._pending[server] = post_message(
                self.pg, self._rank(server), REQUEST_TAG, header, tensors, self._capacity[server]
            )
            return nbytes
        except Exception as error:
            raise self._lost(server, doing, error) from error

    def _recv(self, server: int, doing: str) -> tuple[dict[str, Any], list[Tensor], int]:
        try:
            return recv_message(self.pg, self._rank(server), REPLY_TAG, self._capacity[server], self._buffers[server])
        except Exception as error:
            raise self._lost(server, doing, error) from error

    def _ask_all(
        self, header: dict[str, Any], doing: str, to_first: Sequence[Tensor] = ()
    ) -> list[tuple[dict[str, Any], list[Tensor], int]]:
        if header["op"] == "pull":
            for server in range(self.plan.num_servers):
                if self._next_pull[server] is False:
                    self._send(server, header, [], doing)
            replies = [
                kept if isinstance(kept, tuple) else self._recv(server, doing)
                for server, kept in enumerate(self._next_pull)
            ]
            self._next_pull = [False] * self.plan.num_servers
            return replies
        for server in range(self.plan.num_servers):
            if self._next_pull[server] is True:
                # Answers come in order: read the pull's answer first, and keep it for the next training step.
                self._next_pull[server] = self._recv(server, doing)
            self._send(server, header, list(to_first) if server == 0 else [], doing)
        return [self._recv(server, doing) for server in range(self.plan.num_servers)]

    # --- requests -------------------------------------------------------------------------------------------------

    def init(self, starts: list[ShardState]) -> None:
        """Hand every server its starting shard: parameters, optimizer state and progress (chief only)."""
        for server, start in enumerate(starts):
            header, tensors = start.to_message()
            self._send(server, {"op": "init", **header}, tensors, "starting the servers")

    def pull(self, params: Mapping[str, Tensor], op: str = "pull", step: int = 0, epoch: int = 0) -> PullResult:
        """Fetch every shard into ``params`` (``op`` ``"pull"`` waits for the staleness rule, ``"peek"`` does not)."""
        replies = self._ask_all({"op": op, "step": step, "epoch": epoch}, f"pulling parameters ({op})")
        return self._read_params(replies, params)

    def _read_params(
        self, replies: list[tuple[dict[str, Any], list[Tensor], int]], params: Mapping[str, Tensor]
    ) -> PullResult:
        result = PullResult()
        for server, (header, tensors, nbytes) in enumerate(replies):
            self.bytes_pulled += nbytes
            with torch.no_grad():
                self.plan.unflatten_into(tensors[0], server, params)
            if server == 0:
                result = PullResult(
                    version=int(header["version"]),
                    updates=int(header["updates"]),
                    stop=bool(header["stop"]),
                    lost=list(header["lost"]),
                    gone=list(header["gone"]),
                    staleness_mean=float(header["staleness_mean"]),
                    staleness_max=float(header["staleness_max"]),
                    stats=dict(header["stats"]),
                    lrs=list(header["lrs"]),
                    clocks=list(header["clocks"]),
                )
        return result

    def push(self, grads: Mapping[str, Tensor], basis: int, step: int, epoch: int) -> None:
        """Send every server its part of the gradient, computed on parameters of version ``basis``.

        The push also asks for the next pull, so the servers answer it as soon as the staleness rule allows, while
        this worker finishes its step; :meth:`pull` then only reads the answer.
        """
        header = {
            "op": "push",
            "basis": basis,
            "step": step,
            "epoch": epoch,
            "compression": self.compression,
            "then_pull": True,
        }
        for server in range(self.plan.num_servers):
            if self._next_pull[server] is not False:
                raise RuntimeError("push() twice without a pull() between them; the strategy pulls after every push.")
            flat = self.plan.flatten(grads, server).float().cpu()
            payload = self.compressors[server].encode(flat)
            # Not waited for: the push travels while this worker moves on; the next request waits for it.
            self.bytes_pushed += self._send(server, header, payload, "pushing gradients", wait=False)
            self._next_pull[server] = True

    def status(self) -> list[int]:
        """Workers that no longer take part: lost or finished (asks server 0)."""
        doing = "asking for the live workers"
        if self._next_pull[0] is True:
            self._next_pull[0] = self._recv(0, doing)
        self._send(0, {"op": "status"}, [], doing)
        header, _, _ = self._recv(0, doing)
        return list(header["gone"])

    def state(self) -> list[ShardState]:
        """Every server's shard, optimizer state, scheduler state and progress (chief only)."""
        replies = self._ask_all({"op": "state"}, "saving a checkpoint")
        return [ShardState.from_message(header, tensors) for header, tensors, _ in replies]

    def save(self, path: str, group_names: list[list[str]], chief_model: Mapping[str, Tensor]) -> list[dict[str, Any]]:
        """Have every server write its part of a sharded checkpoint into ``path``; their answers (chief only).

        Server 0 also writes ``chief_model`` (state no server holds) and the param groups, named by ``group_names``.

        Raises:
            RuntimeError: when a server could not write its part, with its error.

        """
        header = {"op": "save", "path": path, "group_names": group_names, "chief_model": list(chief_model)}
        replies = self._ask_all(header, "saving a sharded checkpoint", to_first=list(chief_model.values()))
        for server, (answer, _, _) in enumerate(replies):
            if answer.get("error"):
                raise RuntimeError(
                    f"Parameter server {server} could not write its part of the sharded checkpoint {path}:"
                    f" {answer['error']}. Check that every server can write to that path (shared storage across"
                    " machines), or use state_dict_type='full'."
                )
        return [answer for answer, _, _ in replies]

    def done(
        self, params: Mapping[str, Tensor], step: int, epoch: int, with_state: bool = False
    ) -> tuple[PullResult, list[ShardState]]:
        """Tell every server this worker finished; once every worker has, fetch the final parameters into ``params``.

        Args:
            params: the worker's parameters, overwritten with the servers' final values.
            step: this worker's last step.
            epoch: this worker's last epoch.
            with_state: also return every server's state, as :meth:`state` does (the chief's final checkpoint).

        Returns:
            The pull's result, and the servers' states (empty without ``with_state``).

        """
        header = {"op": "done", "step": step, "epoch": epoch, "with_state": with_state}
        replies = self._ask_all(header, "finishing (the servers answer once every worker has finished)")
        result = self._read_params(replies, params)
        states = [ShardState.from_message(header, tensors) for header, tensors, _ in replies] if with_state else []
        return result, states
