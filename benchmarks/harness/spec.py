"""What a benchmark compares: its arms, how often each runs, and the interleaved order of the runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Arm:
    """One configuration under comparison: ``name`` keys records and charts, ``params`` go to the run, ``label``
    names it in tables (``name`` when empty)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    @property
    def title(self) -> str:
        return self.label or self.name


@dataclass(frozen=True)
class Experiment:
    """Arms (in table order) run ``repeats`` times each, interleaved (:func:`interleave`); ratios are taken per repeat
    against ``baseline``."""

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
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise KeyError(f"no arm {name!r}; the arms are {[a.name for a in self.arms]}")

    def order(self) -> list[tuple[int, Arm]]:
        """Every run as ``(repeat, arm)``, in launch order."""
        return [(r, self.arm(n)) for r, n in interleave([a.name for a in self.arms], self.repeats, self.rotate)]


def round_order(items: Sequence[T], r: int) -> list[T]:
    """Round ``r``'s order of ``items``: rounds come in pairs, a rotation and its reverse, and each pair rotates one
    further (A B C, C B A, B C A, A C B, C A B, B A C; two items: A B, B A, B A, A B). Every item leads and trails, and
    its neighbours run on both sides of it (a plain rotation keeps B after A in every round), so neither drift in the
    machine's load nor a neighbour's after-effects (a warm cache, a busy core) favours one item.
    """
    items = list(items)
    if not items:
        return items
    k = (r // 2) % len(items)
    turned = items[k:] + items[:k]
    return turned[::-1] if r % 2 else turned


def interleave(names: Sequence[str], repeats: int, rotate: bool = True) -> list[tuple[int, str]]:
    """The launch order ``(repeat, name)``: every arm once per repeat, in :func:`round_order` (with ``rotate``)."""
    return [(r, n) for r in range(repeats) for n in (round_order(names, r) if rotate else list(names))]
