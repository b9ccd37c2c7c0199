"""From a map of submodule names to devices, the device of every parameter and buffer, or an error naming the fix.

The rules (documented in docs/model-parallel.md):

* names are qualified submodule names relative to the pipelined module, as its ``named_modules()`` spells them;
* a tensor goes with the nearest listed module above the module that registered it, else to the root device;
* a name must be a submodule (not a parameter or buffer, not unknown), and no listed name may lie inside another;
* a tensor registered under several names (tied weights: an embedding and a head sharing one ``Parameter``) must
  land on one device, since one tensor lives on one device; a map that splits its users is refused.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = ["Placement", "resolve"]


@dataclass
class Placement:
    """Where everything of one module goes.

    Attributes:
        modules: the modules that get device hooks, by qualified name (``""`` is the pipelined module itself), and
            the device their forward runs on.
        tensors: ``(module, attribute, kind, device)`` for every parameter (``kind="param"``) and buffer
            (``kind="buffer"``) registration; a tied tensor appears once per name, always with the same device.

    """

    modules: dict[str, torch.device]
    tensors: list[tuple[nn.Module, str, str, torch.device]] = field(default_factory=list)


def _owner(qualified: str) -> str:
    return qualified.rpartition(".")[0]


def _check_names(root: nn.Module, names: list[str], modules: Mapping[str, nn.Module]) -> None:
    kind = type(root).__name__
    for name in names:
        if name in modules:
            continue
        params = dict(root.named_parameters(remove_duplicate=False))
        buffers = dict(root.named_buffers(remove_duplicate=False))
        if name in params or name in buffers:
            what = "parameter" if name in params else "buffer"
            raise ValueError(
                f"device_map names {name!r}, a {what} of `{kind}`, not a submodule; a {what} goes with its module, so"
                f" place {_owner(name) or 'the module that holds it'!r} instead."
            )
        close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
        hint = f" Did you mean {close}?" if close else ""
        raise ValueError(
            f"device_map names {name!r}, which is not a submodule of `{kind}` (names are relative to the pipelined"
            f" module, as in its named_modules()).{hint} Its top-level submodules:"
            f" {[n for n, _ in root.named_children()]}."
        )
    by_object: dict[int, str] = {}
    for name in sorted(names):
        for other in names:
            if other != name and other.startswith(name + "."):
                raise ValueError(
                    f"device_map names both {name!r} and {other!r}, which lies inside it; list the parts of {name!r}"
                    f" you want on different devices and drop {name!r} (its other parts then go to the root device)."
                )
        seen = by_object.setdefault(id(modules[name]), name)
        if seen != name:
            raise ValueError(f"device_map names {seen!r} and {name!r}, which are one module object; list it once.")


def resolve(root: nn.Module, mapping: Mapping[str, torch.device], root_device: torch.device) -> Placement:
    """The placement a map asks for, checked.

    Args:
        root: the pipelined module; names are relative to it.
        mapping: qualified submodule names to devices.
        root_device: where the root module runs and unlisted tensors go.

    Raises:
        ValueError: for an unknown name, a parameter's name, overlapping names, or tied tensors split across devices,
            naming the names and the fix.

    """
    modules = dict(root.named_modules(remove_duplicate=False))
    _check_names(root, list(mapping), modules)

    # By object too, so a module reachable under a second name (an alias) goes where its listed name says.
    listed = {id(modules[name]): name for name in mapping}

    def device_of(module_name: str) -> tuple[torch.device, str]:
        parts = module_name.split(".") if module_name else []
        for end in range(len(parts), 0, -1):
            name = listed.get(id(modules[".".join(parts[:end])]))
            if name is not None:
                return mapping[name], name
        return root_device, ""

    placement = Placement(modules={"": root_device, **mapping})
    first: dict[int, tuple[str, torch.device, str]] = {}  # tensor id -> (its first name, device, listed name)
    for module_name, module in modules.items():
        registered = [("param", module._parameters), ("buffer", module._buffers)]
        for kind, tensors in registered:
            for attr, tensor in tensors.items():
                if not isinstance(tensor, Tensor):
                    continue
                qualified = f"{module_name}.{attr}" if module_name else attr
                device, via = device_of(module_name)
                seen = first.setdefault(id(tensor), (qualified, device, via))
                if seen[1] != device:
                    raise ValueError(
                        f"`{seen[0]}` and `{qualified}` are one tensor (tied weights), but device_map puts them on"
                        f" {seen[1]} (via {seen[2] or 'the root device'!r}) and {device}"
                        f" (via {via or 'the root device'!r})."
                        " A tensor lives on one device: put both users on the same device, e.g."
                        f" device_map={{{(seen[2] or _owner(seen[0]))!r}: '{device}', {(via or _owner(qualified))!r}:"
                        f" '{device}', ...}}."
                    )
                placement.tensors.append((module, attr, kind, device))
    return placement
