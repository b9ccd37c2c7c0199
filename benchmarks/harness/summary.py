"""Medians, spreads and ratios over repeated runs: the figures every benchmark reports."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Record = Mapping[str, Any]


def spread(xs: Iterable[float | None]) -> dict[str, Any] | None:
    """Median, min, max, quartiles and every value (``None`` entries dropped), or ``None`` for no values."""
    runs = [float(x) for x in xs if x is not None]
    if not runs:
        return None
    q1, q3 = (
        (statistics.quantiles(runs, n=4, method="inclusive")[i] for i in (0, 2)) if len(runs) > 1 else (runs[0],) * 2
    )
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "q1": q1, "q3": q3, "runs": runs}


def ok(records: Iterable[Record], arm: str | None = None) -> list[Record]:
    """The records that did not fail (no ``"error"``), of one arm when ``arm`` is given."""
    return [r for r in records if "error" not in r and (arm is None or r["arm"] == arm)]


def values(records: Iterable[Record], arm: str, key: str | Callable[[Record], Any]) -> list[Any]:
    """``key`` (a field, or a function of a record) of every successful run of ``arm``, in repeat order."""
    get = key if callable(key) else (lambda r: r.get(key))
    return [get(r) for r in sorted(ok(records, arm), key=lambda r: r["repeat"])]


def paired(
    records: Iterable[Record],
    arm: str,
    base: str | Sequence[str],
    key: str,
    op: Callable[[float, float], float] = lambda a, b: a / b,
) -> dict[str, Any] | None:
    """Spread of ``op(arm's key, base's key)`` per repeat, over the repeats where both ran and the base is not 0.

    With several ``base`` arms, each repeat takes the smallest of their values (e.g. "the faster of fp32 and bf16").
    """
    bases = [base] if isinstance(base, str) else list(base)
    by_repeat: dict[int, dict[str, float]] = {}
    for r in ok(records):
        if r.get(key) is not None:
            by_repeat.setdefault(r["repeat"], {})[r["arm"]] = r[key]
    out = []
    for rep in sorted(by_repeat):
        got = by_repeat[rep]
        if arm in got and all(b in got for b in bases):
            b = min(got[x] for x in bases)
            if b != 0:
                out.append(op(got[arm], b))
    return spread(out)


def best_of(summary: Mapping[str, Mapping[str, Any]], arms: Iterable[str], key: str) -> str | None:
    """The arm with the smallest median ``key`` among ``arms`` (e.g. the faster of two), or ``None``."""
    medians = {a: summary[a][key]["median"] for a in arms if a in summary and summary[a].get(key)}
    return min(medians, key=medians.__getitem__) if medians else None


def summarise(
    records: Sequence[Record], arms: Sequence[str], keys: Sequence[str], baseline: str | None = None
) -> dict[str, dict[str, Any]]:
    """Per arm: failed runs and their errors, the spread of every key, and ``<key>_ratio`` against the baseline."""
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        mine = [r for r in records if r["arm"] == arm]
        entry: dict[str, Any] = {
            "runs": len(mine),
            "failed_runs": sum("error" in r for r in mine),
            "errors": [r["error"] for r in mine if "error" in r],
        }
        for key in keys:
            entry[key] = spread(values(records, arm, key))
            if baseline is not None and arm != baseline:
                entry[f"{key}_ratio"] = paired(records, arm, baseline, key)
        out[arm] = entry
    return out


def fmt(v: Mapping[str, Any] | None, f: str = ".1f", scale: float = 1.0, iqr: bool = False) -> str:
    """``median [min - max]`` (or ``[q1 - q3]`` with ``iqr``), scaled and formatted; the median alone when the spread
    vanishes at this precision (one run, or runs that agree, e.g. counted bytes); ``-`` for no value."""
    if v is None:
        return "-"
    lo, hi = ("q1", "q3") if iqr else ("min", "max")
    median, low, high = (f"{scale * v[k]:{f}}" for k in ("median", lo, hi))
    return median if low == high == median else f"{median} [{low} - {high}]"
