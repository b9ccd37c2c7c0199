"""Place the submodules of any module on devices by a map of names, and move activations between them with hooks.

``LayerSplitStrategy(device_map=...)`` uses it; one concept per module:

* :mod:`~ds_lightning.device_map.spec`: the option as written, checked at construction;
* :mod:`~ds_lightning.device_map.resolve`: names to the device of every parameter and buffer, refusing ambiguous maps;
* :mod:`~ds_lightning.device_map.units` and :mod:`~ds_lightning.device_map.planner`: what ``"auto"`` places, and
  where (a pure function of sizes and free bytes);
* :mod:`~ds_lightning.device_map.memory`: free bytes per device;
* :mod:`~ds_lightning.device_map.hooks`: moving the tensors, and the forward hooks that move activations;
* :mod:`~ds_lightning.device_map.engine`: all of it in one call.
"""

from ds_lightning.device_map.engine import auto_map, place
from ds_lightning.device_map.hooks import DeviceHooks, move_to
from ds_lightning.device_map.memory import free_bytes
from ds_lightning.device_map.planner import plan
from ds_lightning.device_map.resolve import Placement, resolve
from ds_lightning.device_map.spec import DeviceMapOption, check_device_map, devices_of
from ds_lightning.device_map.units import Group, auto_units

__all__ = [
    "DeviceHooks",
    "DeviceMapOption",
    "Group",
    "Placement",
    "auto_map",
    "auto_units",
    "check_device_map",
    "devices_of",
    "free_bytes",
    "move_to",
    "place",
    "plan",
    "resolve",
]
