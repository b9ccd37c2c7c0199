"""Cluster environments: where ranks, world size and the rendezvous address come from."""

from ds_lightning.environments.tf_config import TFConfig, TFConfigEnvironment, TFConfigError

__all__ = ["TFConfig", "TFConfigEnvironment", "TFConfigError"]
