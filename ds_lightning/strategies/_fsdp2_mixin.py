"""The strategy side of ``MirroredStrategy(sharding_engine="fsdp2")``: where FSDP2 replaces the DDP wrapper.

A mixin placed before the DDP-based base: each override acts only while :attr:`_fully_sharding` is on (otherwise it
is the base's), so ``ds_mirrored``'s own file keeps only the option. The pieces follow Lightning's own
``ModelParallelStrategy`` and ``DDPStrategy``:

- set-up: ``fully_shard`` in place of the DDP wrap (the LightningModule stays ``strategy.model``), then the optimizers,
  so they hold the sharded ``DTensor`` parameters; under :attr:`shard_parameters` finer units that reshard after their
  forward, with the precision and offload policies of :mod:`ds_lightning.sharding.zero3`;
- steps: ``training_step`` (and validation, test, predict) run through the root's ``__call__`` (Lightning's forward
  redirection), so FSDP's root hooks gather the parameters before any child runs;
- accumulation: ``set_requires_gradient_sync(False)`` where DDP would take ``no_sync()``;
- checkpoints: the plain layouts, gathered on rank 0 and scattered back (see :mod:`ds_lightning.sharding.fsdp2`);
  under ``state_dict_type="sharded"`` (or from a sharded folder) the base's sharded path instead, which writes and
  reads each rank's ``DTensor`` shards with ``torch.distributed.checkpoint`` (:mod:`ds_lightning.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning.checkpoint.strategy_hooks import sharded_parts
from ds_lightning.sharding import fsdp2, zero3


class FullyShardedSteps(DDPStrategy):
    """Overrides for a DDP-based strategy that runs FSDP2 instead when :attr:`_fully_sharding` is on."""

    #: Parameters (not only the optimizer state) 1/N per rank between uses; set by the strategy's constructor.
    shard_parameters: bool = False
    #: Sharded parameters and optimizer state in host memory (with :attr:`shard_parameters`).
    cpu_offload: bool = False

    @property
    def _fully_sharding(self) -> bool:
        return False

    @property
    def _sharded_now(self) -> bool:
        return self._fully_sharding and fsdp2.is_fully_sharded(self.model)

    @property
    def _gathers_checkpoints(self) -> bool:
        # Sharded checkpoints go through the base (ShardedCheckpoints, after this mixin in the MRO): no gathering.
        return self._sharded_now and getattr(self, "state_dict_type", "full") != "sharded"

    # --- set-up ---------------------------------------------------------------------------------------------------

    @override
    def configure_ddp(self) -> None:
        if not self._fully_sharding:
            super().configure_ddp()
            return
        assert isinstance(self.model, pl.LightningModule)
        if not self.shard_parameters:
            self.model = fsdp2.shard_module(self.model, self.root_device)
            return
        precision = str(getattr(self.precision_plugin, "precision", ""))
        mp_policy, offload_policy = zero3.fully_shard_policies(precision, self.root_device, self.cpu_offload)
        self.model = fsdp2.shard_module(
            self.model,
            self.root_device,
            units=zero3.parameter_units(self.model),
            reshard_after_forward=True,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )

    @override
    def model_to_device(self) -> None:
        if self._sharded_now and self.cpu_offload:
            return  # the shards live in host memory on purpose; FSDP copies each unit to the device when gathering
        super().model_to_device()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if not self._sharded_now or trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)
            return
        # Evaluating a model that fit() left sharded: FSDP's hooks gather its parameters; DDPStrategy would broadcast
        # rank 0's module states, here rank 0's shards, over every other rank's.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_precision_plugin()

    # --- steps ----------------------------------------------------------------------------------------------------

    def _through_root(self, context: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self.model is not None and self.lightning_module is not None
        with context:
            return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._sharded_now:
            return super().training_step(*args, **kwargs)
        return self._through_root(self.precision_plugin.train_step_context(), "training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._sharded_now:
            return super().validation_step(*args, **kwargs)
        return self._through_root(self.precision_plugin.val_step_context(), "validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._sharded_now:
            return super().test_step(*args, **kwargs)
        return self._through_root(self.precision_plugin.test_step_context(), "test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._sharded_now:
            return super().predict_step(*args, **kwargs)
        return self._through_root(self.precision_plugin.predict_step_context(), "predict_step", *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if not self._sharded_now:
            with super().block_backward_sync():
                yield None
            return
        model = self.model
        assert isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(False)
        try:
            yield None
        finally:
            model.set_requires_gradient_sync(True)

    # --- checkpoints ----------------------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._gathers_checkpoints:
            return super().lightning_module_state_dict()
        assert self.model is not None
        return fsdp2.full_model_state(self.model)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._sharded_now or sharded_parts(checkpoint, "state_dict") is not None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        assert self.model is not None
        fsdp2.load_full_model_state(self.model, checkpoint["state_dict"], strict=strict)

    def _fully_sharded_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        return fsdp2.full_optimizer_state(self.model, optimizer, writer=self.is_global_zero)

    def _load_fully_sharded_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.model is not None
        fsdp2.load_full_optimizer_states(self.model, self.optimizers, checkpoint["optimizer_states"])
