"""Option checks shared by every public constructor.

Each helper returns the value (normalised where that is useful) or raises ``ValueError`` with a message of the form
``name=value must be <rule>, e.g. <example>.``, so a user sees which option was wrong and what to write instead.
``bool`` never counts as a number here: ``True`` is an ``int`` to Python but never what a user meant.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TypeVar

__all__ = [
    "choice",
    "flag",
    "identifier",
    "integer",
    "is_int",
    "is_number",
    "number",
    "optional_integer",
    "positive_numbers",
    "seconds",
]

T = TypeVar("T")


def _fail(name: str, value: object, rule: str, example: str) -> ValueError:
    hint = f", e.g. {example}" if example else ""
    return ValueError(f"{name}={value!r} must be {rule}{hint}.")


def is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """Whether ``value`` is an ``int`` or ``float`` and not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(name: str, value: object, minimum: int, example: str = "", note: str = "") -> int:
    """``value`` as an int ``>= minimum``.

    Args:
        name: the option's name as the user wrote it.
        value: what the user passed.
        minimum: the smallest allowed value.
        example: a corrected call, e.g. ``"GradientAccumulation(steps=4)"``.
        note: what a boundary value means, e.g. ``"0 turns warmup off"``.

    Raises:
        ValueError: naming the value and the fix.

    """
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise _fail(name, value, f"an int >= {minimum}" + (f" ({note})" if note else ""), example)
    return value  # type: ignore[return-value]


def optional_integer(name: str, value: object, minimum: int, example: str = "", note: str = "") -> int | None:
    """Like :func:`integer`, with ``None`` allowed (and returned)."""
    if value is None:
        return None
    return integer(name, value, minimum, example, "or None" + (f"; {note}" if note else ""))


def _interval(above: float | None, at_least: float | None, below: float | None, at_most: float | None) -> str:
    low = f"({above}" if above is not None else f"[{at_least}" if at_least is not None else None
    high = f"{below})" if below is not None else f"{at_most}]" if at_most is not None else None
    if low is not None and high is not None:
        return f"in {low}, {high}"
    if low is not None:
        return f"{'>' if above is not None else '>='} {low[1:]}"
    if high is not None:
        return f"{'<' if below is not None else '<='} {high[:-1]}"
    return "a number"


def number(
    name: str,
    value: object,
    example: str = "",
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
) -> float:
    """``value`` as a float inside the given bounds (``above``/``below`` exclusive, ``at_least``/``at_most`` not).

    Raises:
        ValueError: naming the value, the allowed range and ``example``.

    """
    ok = is_number(value)
    if ok:
        x = float(value)  # type: ignore[arg-type]
        ok = (
            (above is None or x > above)
            and (at_least is None or x >= at_least)
            and (below is None or x < below)
            and (at_most is None or x <= at_most)
        )
    if not ok:
        rule = _interval(above, at_least, below, at_most)
        raise _fail(name, value, rule if rule.startswith("in ") else f"a number {rule}", example)
    return float(value)  # type: ignore[arg-type]


def positive_numbers(name: str, values: Sequence[object] | None, example: str) -> list[float] | None:
    """A non-empty list of numbers ``> 0``, or ``None``.

    Raises:
        ValueError: naming the list and ``example``.

    """
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not values or not all(is_number(v) and v > 0 for v in values):  # type: ignore[operator]
        raise _fail(name, values, "a non-empty list of numbers > 0", example)
    return [float(v) for v in values]  # type: ignore[arg-type]


def flag(name: str, value: object) -> bool:
    """``value`` as a bool; anything else (``"yes"``, ``1``) is refused.

    Raises:
        ValueError: naming the value.

    """
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False.")
    return value


def identifier(name: str, value: object, example: str) -> str:
    """``value`` if it is a Python identifier (an attribute name).

    Raises:
        ValueError: naming the value and ``example``.

    """
    if not isinstance(value, str) or not value.isidentifier():
        raise _fail(name, value, "the name of one attribute (a Python identifier)", example)
    return value


def choice(name: str, value: T, choices: Iterable[T], note: str = "") -> T:
    """``value`` if it is one of ``choices``.

    Args:
        name: the option's name.
        value: what the user passed.
        choices: the allowed values, in the order to list them.
        note: what else is allowed or what the choices mean, appended to the message.

    Raises:
        ValueError: naming the value and listing the choices.

    """
    allowed = list(choices)
    if value not in allowed:
        listed = ", ".join(repr(c) for c in allowed)
        raise ValueError(f"{name}={value!r} is not supported; choose one of {listed}{' ' + note if note else ''}.")
    return value


def seconds(name: str, value: object, example: str) -> timedelta:
    """A duration ``> 0`` given as a number of seconds or a ``datetime.timedelta``, as a ``timedelta``.

    Raises:
        ValueError: naming the value and ``example``.

    """
    if isinstance(value, timedelta):
        if value > timedelta(0):
            return value
    elif is_number(value) and value > 0:  # type: ignore[operator]
        return timedelta(seconds=value)  # type: ignore[arg-type]
    raise _fail(name, value, "a number of seconds > 0 or a positive datetime.timedelta", example)
