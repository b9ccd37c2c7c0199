"""The memory benchmark's modes: what each arm runs (a ``ds_mirrored`` setting, or Lightning's own ``FSDPStrategy``
or ``DeepSpeedStrategy`` beside them), its arm name and title, and the strategy a worker builds for it.

Only :func:`make_strategy` imports Lightning (a worker calls it); the driver reads the names and titles alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["EXTERNAL", "MIRRORED", "MODES", "Mode", "arm_name", "arm_title", "make_strategy", "mode_of"]


@dataclass(frozen=True)
class Mode:
    """One arm's setting.

    Args:
        key: the arm name's prefix (``<key>_p<N>``); ``plain``, ``sharded`` and ``fsdp2`` keep the names the docs read.
        title: the name in tables.
        kwargs: ``MirroredStrategy``'s arguments (``external`` modes: ``None``).
        external: ``"fsdp"`` (Lightning's ``FSDPStrategy``) or ``"deepspeed"`` (``DeepSpeedStrategy``, stage 3).

    """

    key: str
    title: str
    kwargs: dict[str, Any] | None = None
    external: str = ""

    @property
    def shards_parameters(self) -> bool:
        return bool((self.kwargs or {}).get("shard_parameters")) or self.external != ""


MODES = {
    "plain": Mode("plain", "plain", {}),
    "zero": Mode("sharded", "ZeRO-1 (zero)", {"shard_optimizer_state": True, "sharding_engine": "zero"}),
    "fsdp2": Mode("fsdp2", "fsdp2 (no resharding)", {"shard_optimizer_state": True, "sharding_engine": "fsdp2"}),
    "zero3": Mode("zero3", "ZeRO-3", {"shard_parameters": True}),
    "offload": Mode("offload", "ZeRO-3 + CPU offload", {"shard_parameters": True, "cpu_offload": True}),
    "lightning_fsdp": Mode("lfsdp", "Lightning FSDPStrategy (FULL_SHARD)", external="fsdp"),
    "deepspeed": Mode("deepspeed", "Lightning DeepSpeedStrategy (stage 3)", external="deepspeed"),
}
#: the ``ds_mirrored`` modes, and Lightning's own strategies run beside them
MIRRORED = ("plain", "zero", "fsdp2", "zero3", "offload")
EXTERNAL = ("lightning_fsdp", "deepspeed")


def arm_name(mode: str, procs: int) -> str:
    """``plain_p2``, ``sharded_p4`` (zero), ``fsdp2_p2``, ``zero3_p4``, ``offload_p2``, ``lfsdp_p4``, ...."""
    return f"{MODES[mode].key}_p{procs}"


def arm_title(mode: str, procs: int) -> str:
    return f"{MODES[mode].title}, {procs} procs"


def mode_of(arm: str) -> str:
    """The mode of an arm name (the inverse of :func:`arm_name`)."""
    key = arm.rsplit("_p", 1)[0]
    return next(m for m, v in MODES.items() if v.key == key)


def make_strategy(mode: str, units: set[type] | None = None, extra_path: str = "", **extra: Any) -> Any:
    """The strategy a worker runs for ``mode``; ``extra`` goes to ``MirroredStrategy`` (e.g. ``state_dict_type``).

    Args:
        mode: a key of :data:`MODES`.
        units: the module classes Lightning's ``FSDPStrategy`` wraps (the units ZeRO-3 shards), for ``lightning_fsdp``.
        extra_path: a folder put on ``sys.path`` first (where the optional ``deepspeed`` is installed).
        extra: more ``MirroredStrategy`` arguments.

    """
    spec = MODES[mode]
    if spec.external == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy=units, process_group_backend="gloo")
    if spec.external == "deepspeed":
        if extra_path and extra_path not in sys.path:
            sys.path.insert(0, extra_path)
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=3, process_group_backend="gloo")
    import ds_lightning

    return ds_lightning.MirroredStrategy(**(spec.kwargs or {}), **extra)
