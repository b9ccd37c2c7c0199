"""Two GPUs on a CPU machine, for checking where tensors meet: every tensor carries a virtual device, and an op whose
tensor inputs carry different ones raises, as CUDA would ("Expected all tensors to be on the same device").

All data stays on the CPU. :func:`virtual_place` applies a device map's placement by tagging (parameters and buffers
with their module's device) and swaps the hooks' device move for a tagging one, so the real hooks run and decide where
every activation goes; :class:`VirtualDevices` checks each op of the forward pass. Tensors nobody tagged (made inside
a forward, e.g. ``torch.arange``) match any device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

import ds_lightning.device_map.hooks as hooks_module
from ds_lightning.device_map import DeviceHooks, resolve

__all__ = ["VirtualDevices", "virtual_place"]


class VirtualDevices(TorchFunctionMode):
    """The virtual device of every tensor, checked and propagated op by op."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.ops = 0

    def tag(self, tensor: Tensor, device: torch.device) -> Tensor:
        self.tags[tensor] = device
        return tensor

    def device_of(self, tensor: Tensor) -> torch.device | None:
        return self.tags.get(tensor)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        devices = {d for d in (self.tags.get(t) for t in inputs) if d is not None}
        if len(devices) > 1:
            name = getattr(func, "__name__", func)
            raise RuntimeError(f"virtual devices mixed in {name}: {sorted(map(str, devices))}")
        self.ops += 1
        out = func(*args, **kwargs)
        if devices:
            (device,) = devices
            for t in tree_leaves(out):
                if isinstance(t, Tensor) and t not in self.tags:
                    self.tags[t] = device
        return out


@contextmanager
def virtual_place(
    root: nn.Module,
    mapping: dict[str, torch.device],
    root_device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    hooks: bool = True,
) -> Iterator[VirtualDevices]:
    """Inside: ``root`` placed by ``mapping`` on virtual devices, its forward checked. ``hooks=False`` tags only."""
    mode = VirtualDevices()

    def move_to(data: Any, device: torch.device) -> Any:
        # A new view, so the caller's own tensor keeps its device; views are differentiable like `.to`.
        return apply_to_collection(data, Tensor, lambda t: mode.tag(t.view_as(t), device))

    def first_device(data: Any) -> torch.device | None:
        found = [mode.device_of(t) for t in tree_leaves(data) if isinstance(t, Tensor)]
        return next((d for d in found if d is not None), None)

    monkeypatch.setattr(hooks_module, "move_to", move_to)
    monkeypatch.setattr(hooks_module, "_first_device", first_device)
    placement = resolve(root, mapping, root_device)
    for module, attr, kind, device in placement.tensors:
        registry = module._parameters if kind == "param" else module._buffers
        tensor = registry[attr]
        assert tensor is not None
        mode.tag(tensor, device)
    attached = DeviceHooks(root, placement, root_device)
    if hooks:
        for name, device in placement.modules.items():  # attach() without its real tensor moves
            attached._hook(name, root.get_submodule(name), device)
    try:
        with mode:
            yield mode
    finally:
        attached.detach()
