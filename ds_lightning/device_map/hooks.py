"""Put a :class:`~ds_lightning.device_map.resolve.Placement` into effect: move the tensors, hook the modules.

Why our own hooks and not accelerate's ``dispatch_model`` (read in accelerate 1.16's ``big_modeling.py`` and
``hooks.py``):

* with one distinct device in the map it attaches no hooks (unless ``force_hooks=True``), and it treats ``"cpu"``
  entries of a GPU map as offload (weights on ``meta``, loaded per forward), which an optimizer cannot train;
* it wraps ``model.to``/``model.cuda`` to warn, and to raise once anything is offloaded, while Lightning moves the
  module at setup and teardown;
* its inner modules leave their outputs on their own device (only the top module returns them), which relies on the
  model's code adding ``.to(device)`` where it mixes tensors, as transformers' models do and ours need not.

Here a forward pre-hook moves every tensor in a placed module's args and kwargs to its device, and a forward hook
moves its outputs back to the device of its caller's tensors (the root device when it got none). So any forward code
works, residual adds and embedding sums included, at the price of one copy in and one copy out per placed module.
``Tensor.to`` is differentiable, so the backward pass retraces the copies and each gradient lands with its parameter.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ds_lightning.device_map.resolve import Placement

__all__ = ["DeviceHooks", "move_to"]


def move_to(data: Any, device: torch.device) -> Any:
    """Every tensor in ``data`` (tuples, lists, dicts, dataclasses) on ``device``; the device move the hooks use."""
    return apply_to_collection(data, Tensor, lambda tensor: tensor.to(device))


def _first_device(data: Any) -> torch.device | None:
    found: list[torch.device] = []
    apply_to_collection(data, Tensor, lambda tensor: found.append(tensor.device))
    return found[0] if found else None


class DeviceHooks:
    """The hooks of one placement: :meth:`attach` moves the tensors and registers them, :meth:`detach` removes them.

    Attributes:
        calls: forward calls each hooked module made (by qualified name), proof that the hooks ran.

    """

    def __init__(self, root: nn.Module, placement: Placement, root_device: torch.device) -> None:
        self.root = root
        self.placement = placement
        self.root_device = root_device
        self.calls: Counter[str] = Counter()
        self._handles: list[RemovableHandle] = []

    def _move_tensors(self) -> None:
        moved: dict[int, Tensor] = {}
        for module, attr, kind, device in self.placement.tensors:
            registry = module._parameters if kind == "param" else module._buffers
            tensor = registry[attr]
            assert tensor is not None
            if id(tensor) in moved:
                registry[attr] = moved[id(tensor)]  # type: ignore[assignment]
                continue
            if isinstance(tensor, nn.Parameter):
                # In place on the Parameter object: tied names keep sharing it, and its identity survives.
                tensor.data = tensor.data.to(device)
                if tensor.grad is not None:
                    tensor.grad = tensor.grad.to(device)
                moved[id(tensor)] = tensor
            else:
                moved[id(tensor)] = registry[attr] = tensor.to(device)  # type: ignore[assignment]

    def _hook(self, name: str, module: nn.Module, device: torch.device) -> None:
        callers: list[torch.device | None] = []  # a stack: a module may be re-entered (recursion, recomputation)

        def pre(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            self.calls[name] += 1
            callers.append(_first_device((args, kwargs)))
            return move_to(args, device), move_to(kwargs, device)

        def post(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            caller = callers.pop() if callers else None
            return move_to(output, caller or self.root_device)

        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        # always_call: the stack is popped even when the forward raises.
        self._handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))

    def attach(self) -> None:
        """Move every tensor to its device and hook every placed module (idempotent)."""
        self.detach()
        self._move_tensors()
        for name, device in self.placement.modules.items():
            self._hook(name, self.root.get_submodule(name), device)

    def detach(self) -> None:
        """Remove the hooks; the tensors stay where they are."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
