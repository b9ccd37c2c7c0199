"""What ``"auto"`` places: the model cut into units (submodules kept whole), tied users merged, with their bytes.

A unit is a submodule that holds parameters or buffers. Starting at the pipelined module, a child is opened into its
own children when it is a ``ModuleList``/``ModuleDict`` (containers, never called themselves) or when it alone holds
more than one device's share of the bytes (so a model wrapped in one big submodule, like transformers'
``GPT2LMHeadModel.transformer``, still splits); otherwise it stays whole, so each transformer block lands on one
device. Tensors registered directly on the root or on an opened module stay on the root device.

Units that share a tensor (a head tied to the embedding) become one group, placed together; a group sharing a tensor
with the root's own tensors is pinned to the root device.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["Group", "auto_units"]


@dataclass(frozen=True)
class Group:
    """Submodules placed together, by qualified name, and the bytes of their distinct tensors."""

    names: tuple[str, ...]
    nbytes: int


def _tensors(module: nn.Module, recurse: bool = True) -> dict[int, Tensor]:
    found: dict[int, Tensor] = {}
    for tensor in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
        found.setdefault(id(tensor), tensor)
    return found


def _nbytes(tensors: dict[int, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def auto_units(root: nn.Module, n_devices: int) -> tuple[list[Group], list[Group], int]:
    """Cut ``root`` into groups for the planner.

    Returns:
        ``(groups, pinned, root_bytes)``: the groups to place, in forward (registration) order; the groups that must
        stay on the root device; and the bytes of the tensors that stay on the root device outside any group.

    """
    share = _nbytes(_tensors(root)) / max(1, n_devices)
    units: list[str] = []
    seen: set[int] = {id(root)}  # a module registered twice (an alias) is one unit, under its first name
    root_owned: dict[int, Tensor] = _tensors(root, recurse=False)

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            qualified = f"{prefix}.{name}" if prefix else name
            if id(child) in seen:
                continue
            seen.add(id(child))
            size = _nbytes(_tensors(child))
            if size == 0:
                continue  # nothing to place: it runs wherever its inputs are
            has_children = next(child.children(), None) is not None
            if has_children and (isinstance(child, (nn.ModuleList, nn.ModuleDict)) or size > share):
                root_owned.update(_tensors(child, recurse=False))
                visit(qualified, child)
            else:
                units.append(qualified)

    visit("", root)
    modules = dict(root.named_modules(remove_duplicate=False))
    # Union-find over units that share a tensor; index -1 stands for the root device.
    parent = list(range(len(units)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {key: -1 for key in root_owned}
    pinned_roots: set[int] = set()
    for index, name in enumerate(units):
        for key in _tensors(modules[name]):
            other = owner.setdefault(key, index)
            if other == -1:
                pinned_roots.add(index)
            elif other != index:
                a, b = find(other), find(index)
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[str]] = {}
    for index, name in enumerate(units):
        groups.setdefault(find(index), []).append(name)
    pinned_sets = {find(i) for i in pinned_roots}
    placed: list[Group] = []
    pinned: list[Group] = []
    for leader, names in groups.items():  # dict order: by each group's first unit
        tensors: dict[int, Tensor] = {}
        for name in names:
            tensors.update(_tensors(modules[name]))
        group = Group(tuple(names), _nbytes({k: t for k, t in tensors.items() if k not in root_owned}))
        (pinned if leader in pinned_sets else placed).append(group)
    return placed, pinned, _nbytes(root_owned)
