"""One call from the strategy: the map (explicit or ``"auto"``) resolved against a module, and its hooks attached."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import nn

from ds_lightning.device_map.hooks import DeviceHooks
from ds_lightning.device_map.memory import free_bytes
from ds_lightning.device_map.planner import plan
from ds_lightning.device_map.resolve import resolve
from ds_lightning.device_map.units import auto_units

__all__ = ["auto_map", "place"]


def auto_map(
    root: nn.Module, devices: Sequence[torch.device], free: Sequence[int], *, balanced: bool = True
) -> dict[str, torch.device]:
    """The map ``"auto"`` writes: units balanced by bytes against each slot's free bytes (slot 0 is the root).

    ``balanced=False`` fills the devices in order instead (the planner's control). Pure: nothing is moved, so any
    devices can be named, on any machine.
    """
    groups, pinned, root_bytes = auto_units(root, len(devices))
    base = [root_bytes + sum(g.nbytes for g in pinned)] + [0] * (len(devices) - 1)
    slots = plan([g.nbytes for g in groups], free, base=base, balanced=balanced)
    mapping = {name: devices[0] for group in pinned for name in group.names}
    for group, slot in zip(groups, slots, strict=True):
        mapping.update(dict.fromkeys(group.names, devices[slot]))
    return mapping


def place(
    root: nn.Module,
    device_map: Mapping[str, torch.device] | Literal["auto"],
    devices: Sequence[torch.device],
) -> tuple[DeviceHooks, dict[str, torch.device]]:
    """Resolve ``device_map`` on ``root``, move its tensors and attach the hooks.

    Args:
        root: the pipelined module; the map's names are relative to it.
        device_map: qualified submodule names to devices, or ``"auto"``.
        devices: the strategy's devices; the first is the root device, and ``"auto"`` places over all of them.

    Returns:
        The attached hooks, and the map in effect (``"auto"``'s plan, or the given map).

    Raises:
        ValueError: for a map that does not fit the module, naming the name and the fix.

    """
    mapping = auto_map(root, devices, free_bytes(devices)) if device_map == "auto" else dict(device_map)
    hooks = DeviceHooks(root, resolve(root, mapping, devices[0]), devices[0])
    hooks.attach()
    return hooks, mapping
