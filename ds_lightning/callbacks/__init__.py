"""Callbacks that speed up distributed training; each composes with every ds strategy or refuses it clearly."""

from ds_lightning.callbacks.backup_and_restore import BackupAndRestore
from ds_lightning.callbacks.distributed_report import DistributedReport
from ds_lightning.callbacks.gradient_accumulation import GradientAccumulation
from ds_lightning.callbacks.load_balancer import DynamicLoadBalancer
from ds_lightning.callbacks.lr_scaling import LRScaling
from ds_lightning.callbacks.mixed_precision import MixedPrecision

__all__ = [
    "BackupAndRestore",
    "DistributedReport",
    "DynamicLoadBalancer",
    "GradientAccumulation",
    "LRScaling",
    "MixedPrecision",
]
