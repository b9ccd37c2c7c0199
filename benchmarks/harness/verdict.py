"""The one verdict rule: a target is met only when the median over at least three launches meets it; and
:func:`judged`, the entry every benchmark's ``summary["verdicts"]`` holds per target, judged by that rule."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: launches per arm a verdict rests on; fewer (a ``--quick`` run) are reported but not judged
MIN_LAUNCHES = 3
#: every verdict :func:`verdict` gives, best first
VERDICTS = ("met", "within noise", "missed", "not judged", "no data")


def verdict(value: Mapping[str, Any] | None, at_most: float | None = None, at_least: float | None = None) -> str:
    """Judge a spread over launches (:func:`harness.spread`) against one bound: ``"met"`` when the median meets it,
    ``"within noise"`` when the launches' min-max spread reaches it, else ``"missed"``; ``"not judged"`` under
    :data:`MIN_LAUNCHES` launches, ``"no data"`` without a value."""
    if (at_most is None) == (at_least is None):
        raise ValueError(f"verdict(at_most={at_most}, at_least={at_least}): give exactly one of the two bounds.")
    if not value:
        return "no data"
    if len(value.get("runs", ())) < MIN_LAUNCHES:
        return "not judged"
    target = at_most if at_most is not None else at_least
    median = value["median"]
    if (median <= target) if at_most is not None else (median >= target):
        return "met"
    return "within noise" if value["min"] <= target <= value["max"] else "missed"


def is_met(value: Mapping[str, Any] | None, at_most: float | None = None, at_least: float | None = None) -> bool | None:
    """The verdict as the JSON's ``met`` flag: ``True`` only for ``"met"``, ``None`` without data or launches."""
    v = verdict(value, at_most, at_least)
    return None if v in ("no data", "not judged") else v == "met"


def judged(
    what: str,
    value: Mapping[str, Any] | None,
    at_most: float | None = None,
    at_least: float | None = None,
    *,
    unit: str = "",
    spec: str = ".2f",
    holds: bool | None = True,
) -> dict[str, Any]:
    """One target as ``summary["verdicts"]`` lists it: ``{"what", "target", "median", "min", "max", "launches",
    "verdict"}``, ``target`` e.g. ``"<= 1.10x"`` (the bound in ``spec``, then ``unit``). ``holds`` is a condition
    without a spread of its own: ``False`` makes a judged figure "missed", ``None`` (unmeasured) a met one "no data"."""
    rule = verdict(value, at_most, at_least)
    if holds is False and rule in ("met", "within noise", "missed"):
        rule = "missed"
    elif holds is None and rule == "met":
        rule = "no data"
    sign, bound = ("<=", at_most) if at_most is not None else (">=", at_least)
    return {
        "what": what,
        "target": f"{sign} {bound:{spec}}{unit}",
        **{k: (float(value[k]) if value else None) for k in ("median", "min", "max")},
        "launches": len(value.get("runs", ())) if value else 0,
        "verdict": rule,
    }
