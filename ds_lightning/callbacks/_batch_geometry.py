"""How big a batch each optimizer step sees, read from the running trainer (shared by the callbacks)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ds_lightning.callbacks.load_balancer import DynamicLoadBalancer


def data_parallel_size(trainer: Any) -> int:
    """Processes that read different samples: the distributed sampler's replicas (1 without one).

    ``ds_mirrored`` gives the world size, ``ds_pipeline`` its pipeline replicas (the stages of one replica read the
    same batches), ``ds_parameter_server`` its workers.
    """
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))


def per_device_batch_size(trainer: Any, who: str) -> int:
    """The batch size of the training DataLoader on this process.

    Raises:
        MisconfigurationException: when it cannot be read, naming ``who`` and the fix.

    """
    loader = trainer.train_dataloader
    if isinstance(loader, (list, tuple)) and len(loader) == 1:
        loader = loader[0]
    if isinstance(loader, dict) and len(loader) == 1:
        loader = next(iter(loader.values()))
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if not isinstance(size, int) or size < 1:
        raise MisconfigurationException(
            f"{who} needs the per-device batch size, but the training DataLoader ({type(loader).__name__}) does not"
            " expose one. Return a single torch DataLoader built with `batch_size=...` from train_dataloader()."
        )
    return size


def samples_per_micro_step(trainer: Any, who: str) -> int:
    """Samples one forward/backward pass takes over all data-parallel processes.

    A :class:`~ds_lightning.callbacks.DynamicLoadBalancer` fixes it at its global batch size (the DataLoader's own
    batch size is then unused); otherwise it is the per-device batch size times the data-parallel size.
    """
    for callback in trainer.callbacks:
        if isinstance(callback, DynamicLoadBalancer) and callback.plan is not None:
            return callback.plan.global_batch_size  # also when the balancer read it from the DataLoader
    return per_device_batch_size(trainer, who) * data_parallel_size(trainer)
