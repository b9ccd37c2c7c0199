"""The parameter-server engine behind ``ds_parameter_server``; tensors only on the wire.

One concept a module: launch, channel, server_loop (a server's request loop), server_process (a server process's
part of ``fit``), client, tensor_messages (framed tensors over gloo), sharding (which server holds what), staleness,
optimizer_shard, push_compression, worker_step, collectives (the survivors'), checkpoint (the typed layout and its
consolidation), options. Who serves under each launch is in :mod:`ds_lightning.environments.parameter_server_roles`.
The errors a user can catch are exported here.
"""

from ds_lightning.parameter_server.client import ServerLostError

__all__ = ["ServerLostError"]
