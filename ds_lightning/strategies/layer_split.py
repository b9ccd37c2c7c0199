"""``ds_model_parallel``: one process splits a model across devices.

Either an ``nn.Sequential`` cut into stages fed GPipe micro-batches, or the submodules of any module placed by a
``device_map`` (the engine is :mod:`ds_lightning.device_map`).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.data.resumable import DataCursor, position_loader
from ds_lightning.device_map import DeviceHooks, check_device_map, devices_of, place
from ds_lightning.environments.external_launch import refuse_several_launched
from ds_lightning.pipeline.compiled import refuse_compiled_part
from ds_lightning.pipeline.microbatch import MicroBatchedSequential
from ds_lightning.pipeline.partition import check_balance, resolve_balance
from ds_lightning.pipeline.profile import auto_balance
from ds_lightning.strategies._stage_devices import check_root_device, parse_stage_devices

__all__ = ["LayerSplitStrategy"]

_CPU = torch.device("cpu")


def _optimizer_states_to_param_devices(optimizers: Sequence[Optimizer]) -> None:
    """Move each optimizer state next to its parameter (Lightning moves them all to the root device)."""
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        for param, state in list(optimizer.state.items()):
            if not isinstance(param, Tensor):
                continue
            if not isinstance(state, MutableMapping):
                optimizer.state[param] = apply_to_collection(
                    state, Tensor, move_data_to_device, param.device, allow_frozen=True
                )
                continue
            for key, value in state.items():
                # 'step' stays where the optimizer keeps it (usually the CPU), as in Lightning's _optimizer_to_device.
                if key != "step":
                    state[key] = move_data_to_device(value, param.device)


@contextmanager
def _without_child(module: nn.Module, name: str) -> Iterator[None]:
    """Hide one child from ``module.to()`` and friends; its slot (and so the ``state_dict`` order) is kept."""
    child = module._modules[name]
    module._modules[name] = None
    try:
        yield
    finally:
        module._modules[name] = child


def _check_map_options(device_map: object, n_microbatches: int, balance: object, checkpointing: object) -> None:
    """device_map runs the module's own forward whole: the Sequential split's options have nothing to act on."""
    for option, value, default in (
        ("n_microbatches", n_microbatches, 1),
        ("balance", balance, None),
        ("activation_checkpointing", checkpointing, False),
    ):
        if value != default:
            raise ValueError(
                f"LayerSplitStrategy(device_map={device_map!r}, {option}={value!r}): {option} applies to the"
                " nn.Sequential split, while device_map runs your module's own forward with its parts on their"
                f" devices; drop {option}, or drop device_map to split an nn.Sequential."
            )


def _check_map_within(device_map: object, mapping: dict[str, torch.device], devices: list[torch.device]) -> None:
    outside = sorted({str(d) for d in mapping.values() if d not in devices})
    if outside:
        raise ValueError(
            f"device_map={device_map!r} uses {outside}, not in devices={[str(d) for d in devices]}; add them to"
            " devices, or leave devices unset to use the map's own devices."
        )


class LayerSplitStrategy(SingleDeviceStrategy):
    """Single-process model parallelism: an ``nn.Sequential`` split GPipe-style, or any module by ``device_map``.

    The classic "first part on ``cuda:0``, second part on ``cuda:1``" split, plus micro-batching so the devices can
    work on different micro-batches at once (GPipe fill-drain order; CUDA kernels launch asynchronously). The
    LightningModule trains unchanged: the ``nn.Sequential`` attribute named by ``pipe_module`` is replaced during
    ``fit``/``validate``/``test``/``predict`` by a wrapper holding the same layer objects, so ``state_dict`` keys,
    checkpoints and the optimizer's parameters are those of the plain module; afterwards the original
    ``nn.Sequential`` is put back. Batches go to the first device, and the split part returns its output there.

    Checkpoints hold their tensors on the CPU, so a run on four GPUs can be loaded on a machine with one.

    Micro-batching leaves the computed function unchanged for layers that treat rows independently; layers that mix
    rows of a batch (``BatchNorm``) see micro-batches instead of the whole batch.

    ``SingleDeviceStrategy``'s arguments come first, in its positions; the split options are keyword-only.

    Args:
        device: where batches arrive and the split part returns its output: the first stage's device, which is
            what ``None`` means; any other value is refused, naming the first of ``devices``.
        accelerator: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        devices: one device per stage, all of one type, e.g. ``["cuda:0", "cuda:1"]``. ``None``: every visible CUDA
            device, or ``["cpu", "cpu"]`` without CUDA (two stages on the CPU, which exercises the split).
        n_microbatches: micro-batches per batch; a batch with fewer rows gets one micro-batch per row.
        balance: layers per stage. ``None``: equal counts (earlier stages take one more). ``"auto"``: split by the
            forward + backward time of every layer on ``LightningModule.example_input_array``, measured on the first
            device at setup. A list: explicit counts, one per device.
        pipe_module: name of the LightningModule's ``nn.Sequential`` attribute to split.
        activation_checkpointing: keep only each stage's input per micro-batch and recompute the rest in the
            backward pass, trading compute for activation memory.
        device_map: place submodules of ``pipe_module`` (any ``nn.Module``, not only an ``nn.Sequential``) by
            qualified name, e.g. ``{"blocks.0": "cuda:0", "blocks.1": "cuda:1"}``, or ``"auto"`` to balance
            parameter bytes against each device's free memory; unlisted tensors go with their nearest listed parent,
            else to the root device. Without ``devices``, a map's own devices are used (lowest index first). Runs the
            module's own forward whole, so ``n_microbatches``, ``balance`` and ``activation_checkpointing`` stay at
            their defaults. See docs/model-parallel.md.

    Raises:
        ValueError: for any invalid option, naming the value and the fix.

    """

    strategy_name = "ds_model_parallel"

    def __init__(
        self,
        device: str | torch.device | int | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        devices: list[str] | None = None,
        n_microbatches: int = 1,
        balance: list[int] | Literal["auto"] | None = None,
        pipe_module: str = "net",
        activation_checkpointing: bool = False,
        device_map: dict[str, str | int] | Literal["auto"] | None = None,
    ) -> None:
        checked_map = check_device_map(device_map)
        if checked_map is not None:
            _check_map_options(device_map, n_microbatches, balance, activation_checkpointing)
            if devices is None and checked_map != "auto":
                devices = [str(d) for d in devices_of(checked_map)]
        stage_devices = parse_stage_devices(devices)
        if isinstance(checked_map, dict):
            _check_map_within(device_map, checked_map, stage_devices)
        check_root_device(device, stage_devices)
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(
                f"n_microbatches={n_microbatches!r} must be an integer >= 1, e.g. "
                "LayerSplitStrategy(n_microbatches=4); 1 runs each batch whole."
            )
        checked_balance = check_balance(balance, len(stage_devices))
        check.identifier(
            "pipe_module", pipe_module, "pipe_module='net' for the LightningModule's `self.net = nn.Sequential(...)`"
        )
        check.flag("activation_checkpointing", activation_checkpointing)
        super().__init__(
            device=stage_devices[0],
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._stage_devices = stage_devices
        self.n_microbatches = n_microbatches
        self.balance = checked_balance
        self.pipe_module = pipe_module
        self.activation_checkpointing = activation_checkpointing
        self._balance_used: list[int] | None = None
        self._original: nn.Sequential | None = None
        self.device_map = checked_map
        self._device_hooks: DeviceHooks | None = None
        self._device_map_used: dict[str, torch.device] | None = None
        #: Set by :class:`~ds_lightning.callbacks.BackupAndRestore`: where a restored run's training data goes on.
        self.data_cursor: DataCursor | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="ds_lightning single-process model parallelism: an nn.Sequential split across devices"
                " with GPipe micro-batching",
            )

    # --- devices ---------------------------------------------------------------------------------------------------

    @property
    def stage_devices(self) -> list[torch.device]:
        """The device of each stage; the first is the root device, where batches and outputs live."""
        return list(self._stage_devices)

    @property
    def parallel_devices(self) -> list[torch.device]:
        """The stage devices, under the name Lightning's accelerator connector reads.

        With ``Trainer(accelerator="auto")`` this picks the accelerator of the devices' type, and an explicit
        accelerator of another type fails at ``Trainer(...)`` instead of at the first ``.to()``.
        """
        return self.stage_devices

    @property
    def balance_used(self) -> list[int] | None:
        """Layers per stage of the latest setup (resolved from ``balance``), or ``None`` before the first setup."""
        return None if self._balance_used is None else list(self._balance_used)

    @property
    def device_map_used(self) -> dict[str, str] | None:
        """The map of the latest setup (``"auto"``'s plan, or the given map), or ``None`` without ``device_map``."""
        return None if self._device_map_used is None else {k: str(v) for k, v in self._device_map_used.items()}

    @property
    def device_hook_calls(self) -> dict[str, int]:
        """Forward calls of each placed module (``""``: ``pipe_module`` itself) since the latest setup."""
        return {} if self._device_hooks is None else dict(self._device_hooks.calls)

    @override
    def setup_environment(self) -> None:
        refuse_several_launched("ds_model_parallel", "split the model across processes and hosts with ds_pipeline")
        cuda = [d for d in self._stage_devices if d.type == "cuda"]
        if cuda:
            count = torch.cuda.device_count()
            missing = [str(d) for d in cuda if d.index is None or d.index >= count]
            if missing:
                raise ValueError(
                    f"LayerSplitStrategy(devices={[str(d) for d in self._stage_devices]}) names {missing}, but"
                    f" this machine shows {count} CUDA device(s); use indices below {count}"
                    " (CUDA_VISIBLE_DEVICES renumbers them from 0)."
                )
        super().setup_environment()

    # --- the split ---------------------------------------------------------------------------------------------------

    def _pipe_sequence(self, module: LightningModule) -> nn.Sequential:
        name = self.pipe_module
        if name not in module._modules:
            raise AttributeError(
                f"ds_model_parallel splits `{type(module).__name__}.{name}`, which does not exist. Put the layers to"
                f" split in an nn.Sequential attribute, e.g. `self.{name} = nn.Sequential(...)`, or name yours with"
                " LayerSplitStrategy(pipe_module=...)."
            )
        refuse_compiled_part("ds_model_parallel", module, name)
        seq = module._modules[name]
        if not isinstance(seq, nn.Sequential):
            raise TypeError(
                f"ds_model_parallel splits `{type(module).__name__}.{name}`, which is a {type(seq).__name__}, not an"
                " nn.Sequential. The contract: the part to split is an nn.Sequential of layers that each take and"
                f" return one tensor, called from training_step as `self.{name}(x)`."
            )
        if type(seq).forward is not nn.Sequential.forward:
            raise TypeError(
                f"`{type(module).__name__}.{name}` is a {type(seq).__name__} with its own forward, which a split into"
                " stages would not run. Make it a plain nn.Sequential of its layers and keep the extra logic in the"
                " LightningModule."
            )
        return seq

    def _resolve_balance(self, seq: nn.Sequential, module: LightningModule) -> list[int]:
        n_layers, n_stages = len(seq), len(self._stage_devices)
        if self.balance != "auto":
            return resolve_balance(n_layers, n_stages, self.balance)
        resolve_balance(n_layers, n_stages, None)  # more stages than layers fails here, before profiling
        sample = module.example_input_array
        if sample is None:
            raise ValueError(
                f"LayerSplitStrategy(balance='auto') times each layer of `{self.pipe_module}` on"
                " `LightningModule.example_input_array`, which is None. Set `self.example_input_array = torch.randn("
                "batch, ...)` in your module's __init__ (the input of the nn.Sequential), or pass balance=None or an"
                " explicit list."
            )
        if not isinstance(sample, Tensor):
            raise ValueError(
                f"LayerSplitStrategy(balance='auto') needs `example_input_array` to be one tensor (the input of"
                f" `{self.pipe_module}`), got {type(sample).__name__}; set a tensor or pass an explicit balance."
            )
        sample = self.precision_plugin.convert_input(sample)
        with self.precision_plugin.forward_context():
            balance, _ = auto_balance(list(seq), sample, self._stage_devices[0], n_stages)
        return balance

    def _split(self, module: LightningModule) -> None:
        seq = self._pipe_sequence(module)
        balance = self._resolve_balance(seq, module)
        wrapped = MicroBatchedSequential(
            seq, balance, self._stage_devices, self.n_microbatches, self.activation_checkpointing
        )
        setattr(module, self.pipe_module, wrapped)
        self._original = seq
        self._balance_used = balance
        rank_zero_info(
            f"ds_model_parallel: `{self.pipe_module}` ({len(seq)} layers) split with balance={balance} over"
            f" {[str(d) for d in self._stage_devices]}, {self.n_microbatches} micro-batch(es) per batch"
            + (", activation checkpointing" if self.activation_checkpointing else "")
        )

    def _restore(self) -> None:
        module = self.lightning_module
        if self._original is None or module is None:
            return
        wrapped = module._modules.get(self.pipe_module)
        if isinstance(wrapped, MicroBatchedSequential):
            self._original.training = wrapped.training  # the container only; the layers keep their own modes
        setattr(module, self.pipe_module, self._original)
        self._original = None

    @override
    def model_to_device(self) -> None:
        """Split the pipe module (once per setup), put its stages on their devices and the rest on the root device."""
        module = self.lightning_module
        assert module is not None and self.model is not None, "the model must be connected before model_to_device()"
        if self.device_map is not None:
            self._place(module)
            return
        if self._original is None:
            self._split(module)
        wrapped = module._modules[self.pipe_module]
        assert isinstance(wrapped, MicroBatchedSequential)
        with _without_child(module, self.pipe_module):
            self.model.to(self.root_device)
        for layers, device in zip(wrapped._stages, self._stage_devices, strict=True):
            for layer in layers:
                layer.to(device)

    def _place(self, module: LightningModule) -> None:
        target = module._modules.get(self.pipe_module)
        if target is None:
            raise AttributeError(
                f"ds_model_parallel places the submodules of `{type(module).__name__}.{self.pipe_module}` by"
                " device_map, but it does not exist; name the attribute that holds your network with"
                " LayerSplitStrategy(pipe_module=...)."
            )
        refuse_compiled_part("ds_model_parallel", module, self.pipe_module)
        if self._device_hooks is not None:
            self._device_hooks.detach()
        assert self.device_map is not None and self.model is not None
        # The rest first, then the placed module straight to its devices (it may not fit on the root device whole);
        # in this order a submodule also reachable from outside `pipe_module` still ends where the map puts it.
        with _without_child(module, self.pipe_module):
            self.model.to(self.root_device)
        self._device_hooks, self._device_map_used = place(target, self.device_map, self._stage_devices)
        rank_zero_info(f"ds_model_parallel: `{self.pipe_module}` placed by device_map {self.device_map_used}")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # calls model_to_device() after the precision plugin converted the module
        if trainer.state.fn == TrainerFn.FITTING:
            # Strategy.setup moved every optimizer state to the root device.
            _optimizer_states_to_param_devices(self.optimizers)

    @override
    def teardown(self) -> None:
        if self._device_hooks is not None:
            self._device_hooks.detach()  # the call counts stay readable
        self._restore()
        super().teardown()  # moves the (restored) module and the optimizer states to the CPU

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        return position_loader(self, dataloader, self.data_cursor, trainer is not None and trainer.training)

    # --- checkpoints -------------------------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        for key, value in state.items():  # in place: keeps the state_dict's `_metadata` (layer versions)
            if isinstance(value, Tensor):
                state[key] = value.to(_CPU)
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        return move_data_to_device(super().optimizer_state(optimizer), _CPU)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint holds {len(states)} optimizer state(s) but configure_optimizers() returned"
                f" {len(self.optimizers)} optimizer(s); resume with the optimizers the checkpoint was written with."
            )
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)
        _optimizer_states_to_param_devices(self.optimizers)
