"""The ``device_map`` option as the user writes it: checked at construction, before any module exists.

The names are only checked for their shape here (dotted attribute paths); whether they name submodules of the model is
decided at setup by :mod:`ds_lightning.device_map.resolve`, when the model is known.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

__all__ = ["DeviceMapOption", "check_device_map", "devices_of"]

#: What ``LayerSplitStrategy(device_map=...)`` accepts, typed for jsonargparse.
DeviceMapOption = dict[str, str | int] | Literal["auto"] | None

_EXAMPLE = "device_map={'blocks.0': 'cuda:0', 'blocks.1': 'cuda:1'} or device_map='auto'"


def _device(name: str, value: object) -> torch.device:
    # accelerate's maps write a bare int for a GPU index; we accept that spelling too.
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"device_map[{name!r}]={value!r}: a GPU index is >= 0, e.g. {{{name!r}: 0}} for cuda:0.")
        return torch.device("cuda", value)
    if not isinstance(value, str):
        raise ValueError(
            f"device_map[{name!r}]={value!r} must be a device string like 'cuda:1' or 'cpu', or a GPU index like 1."
        )
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device_map[{name!r}]={value!r} is not a torch device; write 'cuda:1', 'cpu' or a GPU index. Offload"
            " ('disk') is not supported: training needs every parameter on a device."
        ) from err
    if device.type == "meta":
        raise ValueError(
            f"device_map[{name!r}]={value!r}: the meta device holds no data, so it cannot train; name a real device."
        )
    if device.type == "cuda" and device.index is None:
        raise ValueError(
            f"device_map[{name!r}]={value!r} has no index, so it would follow the current GPU; write e.g. 'cuda:0'."
        )
    return device


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise ValueError(f"device_map key {name!r} must be a submodule's qualified name (a str), e.g. {_EXAMPLE}.")
    if name == "":
        raise ValueError(
            "device_map key '' names the whole pipelined module; to put all of it on one device use"
            " LayerSplitStrategy(devices=['cuda:1']) without device_map, or name its submodules."
        )
    if not all(part.isidentifier() or part.isdigit() for part in name.split(".")):
        raise ValueError(
            f"device_map key {name!r} is not a dotted submodule name like 'blocks.0' or 'transformer.h.3'; names are"
            " relative to the pipelined module (pipe_module), as in its named_modules()."
        )
    return name


def check_device_map(device_map: object) -> dict[str, torch.device] | Literal["auto"] | None:
    """``device_map`` normalised: ``None``, ``"auto"``, or qualified names mapped to torch devices.

    Raises:
        ValueError: for a value of another type, a malformed name or a value that is not a usable device, naming it
            and the fix.

    """
    if device_map is None or device_map == "auto":
        return device_map
    if not isinstance(device_map, Mapping):
        raise ValueError(
            f"device_map={device_map!r} must be None, 'auto' or a dict of names to devices, e.g. {_EXAMPLE}."
        )
    if not device_map:
        raise ValueError(
            f"device_map={{}} places nothing; leave it None for the nn.Sequential split, or e.g. {_EXAMPLE}."
        )
    return {_check_name(name): _device(name, value) for name, value in device_map.items()}


def devices_of(mapping: Mapping[str, torch.device]) -> list[torch.device]:
    """The distinct devices of a map, by type and index: the first is the root device when ``devices`` is unset."""
    return sorted(set(mapping.values()), key=lambda d: (d.type, -1 if d.index is None else d.index))
