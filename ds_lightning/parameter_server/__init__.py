"""The parameter-server engine behind ``ds_parameter_server``; tensors only on the wire.

One concept a module: launch, channel, server, serving, client, wire, sharding, staleness, optimizer_shard,
push_compression, worker_step, collectives (the survivors'), checkpoint, options. The errors a user can catch are
exported here.
"""

from ds_lightning.parameter_server.client import ServerLostError

__all__ = ["ServerLostError"]
