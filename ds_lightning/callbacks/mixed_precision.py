"""``MixedPrecision``: bf16 or fp16 autocast with a configurable loss scaler, switched on by a callback."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.callbacks._amp_plugin import MixedPrecision as _AmpPlugin
from ds_lightning.strategies.capabilities import capabilities_of

__all__ = ["MixedPrecision", "choose_auto_precision"]

PrecisionName = Literal["auto", "bf16", "fp16"]
Chosen = Literal["bf16", "fp16", "fp32"]

# x86 flags for native bf16 matrix instructions (Sapphire Rapids' AMX, Cooper Lake's and Zen 4's AVX512-BF16): with
# them oneDNN runs bf16 matmuls in hardware; without, bf16 autocast is emulated and many times slower than fp32.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def choose_auto_precision(
    device_type: str, *, cuda_bf16: bool = False, cpu_flags: Iterable[str] = ()
) -> tuple[Chosen, str]:
    """What ``MixedPrecision("auto")`` trains in on a device, and why: the precision the device runs fast.

    Args:
        device_type: the root device's type, e.g. ``"cuda"`` or ``"cpu"``.
        cuda_bf16: whether the CUDA device has native bf16, not emulated (``including_emulation=False``).
        cpu_flags: the CPU's feature flags, as in ``/proc/cpuinfo``.

    Returns:
        ``("bf16" | "fp16" | "fp32", reason)``.

    """
    if device_type == "cuda":
        if cuda_bf16:
            return "bf16", "this CUDA device has native bf16"
        return "fp16", "this CUDA device has no native bf16, so fp16 with dynamic loss scaling"
    if device_type == "cpu":
        found = sorted(set(CPU_BF16_FLAGS) & set(cpu_flags))
        if found:
            return "bf16", f"this CPU has native bf16 matrix instructions ({', '.join(found)})"
        return "fp32", (
            f"this CPU has no native bf16 matrix instructions (none of {', '.join(CPU_BF16_FLAGS)} in its flags), so"
            " bf16 autocast would run many times slower than fp32 (benchmarks/results/precision.md)"
        )
    return "fp32", f"'auto' knows no fast low-precision path on a {device_type!r} device"


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo``; empty where it is missing (not Linux), so ``auto`` keeps fp32."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


class MixedPrecision(Callback):
    """Train with automatic mixed precision: the forward pass in bf16 or fp16, parameters and optimizer in fp32.

    ``precision="auto"`` picks what the device runs fast: bf16 on GPUs with native bf16 (Ampere and later) and on
    CPUs with native bf16 matrix instructions (``amx_bf16`` or ``avx512_bf16``), fp16 with dynamic loss scaling on
    older GPUs, and otherwise fp32: the callback then leaves the Trainer's precision alone and says why in one log
    line on rank 0 (bf16 autocast on a CPU without those instructions was measured many times slower than fp32).

    Under fp16 a ``torch.amp.GradScaler`` scales the loss; gradients are unscaled exactly once per optimizer step (also
    under gradient accumulation), before clipping and before ``on_before_optimizer_step``. A step whose gradients hold
    inf or NaN is skipped, so parameters never take them, and it is counted. The scaler's state is saved in
    checkpoints under the same key as ``Trainer(precision="16-mixed")``, so either resumes the other.

    Under the hood the callback installs Lightning's ``MixedPrecision`` precision plugin when the run is set up; do
    not also pass ``precision=`` to the Trainer. Under ``ds_parameter_server`` workers push unscaled gradients and
    an overflowing step pushes nothing. ``ds_pipeline`` runs in 32-bit and is refused.

    Logged on fp16: ``precision/loss_scale`` and ``precision/skipped_steps``.

    Args:
        precision: ``"auto"``, ``"bf16"`` or ``"fp16"``.
        init_scale: the fp16 loss scale to start from.
        growth_factor: multiply the scale by this after ``growth_interval`` steps without overflow (> 1).
        backoff_factor: multiply the scale by this after an overflow, in ``(0, 1)``.
        growth_interval: overflow-free steps before the scale grows.

    Raises:
        ValueError: for an out-of-range option, naming the value and the fix.

    """

    def __init__(
        self,
        precision: PrecisionName = "auto",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        check.choice("precision", precision, ("auto", "bf16", "fp16"))
        check.number("init_scale", init_scale, "MixedPrecision(init_scale=65536.0)", above=0)
        check.number("growth_factor", growth_factor, "MixedPrecision(growth_factor=2.0)", above=1)
        check.number("backoff_factor", backoff_factor, "MixedPrecision(backoff_factor=0.5)", above=0, below=1)
        check.integer("growth_interval", growth_interval, 1, "MixedPrecision(growth_interval=2000)")
        self.precision = precision
        self.init_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.chosen: Chosen | None = None  # once the device is known
        self.plugin: _AmpPlugin | None = None
        self._restored_skipped = 0

    @staticmethod
    def resolve(precision: str, device: torch.device) -> Chosen:
        """What ``precision`` means on ``device``: ``"auto"`` as :func:`choose_auto_precision` decides for it."""
        return MixedPrecision._resolve_with_reason(precision, device)[0]

    @staticmethod
    def _resolve_with_reason(precision: str, device: torch.device) -> tuple[Chosen, str]:
        if precision != "auto":
            return precision, "asked for"  # type: ignore[return-value]
        cuda_bf16 = False
        if device.type == "cuda":
            with torch.cuda.device(device):  # emulated bf16 (pre-Ampere) is slow: it does not count
                cuda_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        flags = read_cpu_flags() if device.type == "cpu" else frozenset()
        return choose_auto_precision(device.type, cuda_bf16=cuda_bf16, cpu_flags=flags)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because their gradients overflowed."""
        return self.plugin.skipped_steps if self.plugin is not None else self._restored_skipped

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not capabilities_of(strategy).precision_plugin_wraps_forward:
            raise MisconfigurationException(
                "MixedPrecision cannot run under ds_pipeline, which runs its stages in 32-bit for now; remove the"
                " callback, or use ds_mirrored or ds_model_parallel for mixed precision."
            )
        current = strategy.precision_plugin
        if type(current) is not Precision and current is not self.plugin:  # ours stays after fit, for saving
            raise MisconfigurationException(
                f"MixedPrecision would replace the Trainer's {type(current).__name__} precision plugin; remove"
                " `precision=` from the Trainer and let the callback choose."
            )
        device = strategy.root_device
        already = self.chosen
        self.chosen, reason = self._resolve_with_reason(self.precision, device)
        if self.chosen == "fp32":
            if already != "fp32":  # once per callback, not again for a validate or test after fit
                rank_zero_info(f"MixedPrecision('auto') trains in fp32: {reason}. Pass precision='bf16' to force it.")
            self.plugin = None
            return
        scaler = None
        if self.chosen == "fp16":
            scaler = torch.amp.GradScaler(
                device.type,
                init_scale=self.init_scale,
                growth_factor=self.growth_factor,
                backoff_factor=self.backoff_factor,
                growth_interval=self.growth_interval,
            )
        self.plugin = _AmpPlugin("16-mixed" if self.chosen == "fp16" else "bf16-mixed", device.type, scaler)
        self._restored_skipped = 0  # a resumed run's count arrives through load_state_dict, after setup
        strategy.precision_plugin = self.plugin

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        every = trainer.log_every_n_steps
        plugin = self.plugin
        if plugin is None or plugin.scaler is None or not every or trainer.global_step % every:
            return
        pl_module.log_dict(
            {
                "precision/loss_scale": float(plugin.scaler.get_scale()),
                "precision/skipped_steps": float(self.skipped_steps),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
            sync_dist=False,  # gradients are all-reduced before the scaler looks: the same on every rank
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "chosen": self.chosen}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_skipped = int(state_dict.get("skipped_steps", 0))
        if self.plugin is not None:
            self.plugin.skipped_steps = self._restored_skipped
