"""Cluster environments: where ranks, world size and the rendezvous address come from, and how tasks reach it."""

from ds_lightning.environments._interfaces import pin_socket_interfaces
from ds_lightning.environments.rendezvous import ALL_INTERFACES_VARIABLE, rendezvous_store
from ds_lightning.environments.tf_config import TFConfig, TFConfigEnvironment, TFConfigError

__all__ = [
    "ALL_INTERFACES_VARIABLE",
    "TFConfig",
    "TFConfigEnvironment",
    "TFConfigError",
    "pin_socket_interfaces",
    "rendezvous_store",
]
