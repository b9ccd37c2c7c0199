"""Registering a strategy class under several names, one per process start method."""

from __future__ import annotations

from lightning.fabric.strategies.registry import _StrategyRegistry


def register_start_methods(
    registry: _StrategyRegistry, cls: type, what: str, entries: tuple[tuple[str, str], ...]
) -> None:
    """Register ``cls`` as each ``(name, start_method)`` not yet taken, e.g. ``("ds_pipeline_spawn", "spawn")``."""
    for name, start_method in entries:
        if name not in registry:
            registry.register(
                name,
                cls,
                description=f"ds_lightning {what} with start_method={start_method!r}",
                start_method=start_method,
            )
