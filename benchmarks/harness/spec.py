"""What a benchmark compares: its arms, how often each runs, and the interleaved order of the runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Arm", "Experiment", "interleave"]


@dataclass(frozen=True)
class Arm:
    """One configuration under comparison.

    Args:
        name: short key, used in records, JSON and chart ticks (e.g. ``"bf16"``).
        params: what the benchmark's run function needs to run this arm (goes into the worker's spec).
        label: the name in tables; ``name`` when empty.

    """

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    @property
    def title(self) -> str:
        """The name shown in tables."""
        return self.label or self.name


@dataclass(frozen=True)
class Experiment:
    """Arms run ``repeats`` times each, interleaved; ratios are taken against ``baseline``.

    Args:
        arms: the configurations, in table order.
        repeats: runs of every arm.
        baseline: the arm every ratio is taken against (per repeat), or ``None`` for no ratios.
        rotate: start each repeat one arm later (A B C, B C A, ...), so no arm always runs first.

    """

    arms: Sequence[Arm]
    repeats: int
    baseline: str | None = None
    rotate: bool = True

    def __post_init__(self) -> None:
        names = [a.name for a in self.arms]
        if not names:
            raise ValueError("Experiment(arms=[]) has nothing to run: give at least one Arm.")
        if len(set(names)) != len(names):
            raise ValueError(f"Experiment arm names {names} repeat a name: give every Arm its own name.")
        if self.repeats < 1:
            raise ValueError(f"Experiment(repeats={self.repeats}) must be >= 1.")
        if self.baseline is not None and self.baseline not in names:
            raise ValueError(f"Experiment(baseline={self.baseline!r}) is not an arm; choose one of {names}.")

    def arm(self, name: str) -> Arm:
        """The arm called ``name``."""
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise KeyError(f"no arm {name!r}; the arms are {[a.name for a in self.arms]}")

    def order(self) -> list[tuple[int, Arm]]:
        """Every run as ``(repeat, arm)``, in launch order: see :func:`interleave`."""
        return [(r, self.arm(n)) for r, n in interleave([a.name for a in self.arms], self.repeats, self.rotate)]


def interleave(names: Sequence[str], repeats: int, rotate: bool = True) -> list[tuple[int, str]]:
    """The launch order ``(repeat, name)``: every arm once per repeat (A B A B ...), so drift in the machine's load
    hits every arm alike; with ``rotate``, repeat r starts at arm r mod n (A B C, B C A, C A B).
    """
    names = list(names)
    order = []
    for r in range(repeats):
        k = r % len(names) if rotate and names else 0
        order += [(r, n) for n in names[k:] + names[:k]]
    return order
