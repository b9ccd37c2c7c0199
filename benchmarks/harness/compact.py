"""Compact results: per-step series summarised into quantiles, and a JSON layout of one line per record."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any


def series(xs: Iterable[float | None]) -> dict[str, Any] | None:
    """A per-step series as its size, median, quartiles and range (what a run's figures and charts read)."""
    v = [float(x) for x in xs if x is not None]
    if not v:
        return None
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0],) * 3
    return {"n": len(v), "median": statistics.median(v), "q1": q1, "q3": q3, "min": min(v), "max": max(v)}


#: significant digits a float keeps in the JSON: finer than any clock here, a fifth smaller than ``repr``
DIGITS = 9


def rounded(x: Any) -> Any:
    """``x`` with every float rounded to :data:`DIGITS` significant digits; checksums keep every digit."""
    if isinstance(x, float):
        return float(f"{x:.{DIGITS}g}")
    if isinstance(x, dict):
        # keys are not always strings here (a driver's dict keyed by micro-batch count): JSON makes them strings later
        return {k: v if isinstance(k, str) and "checksum" in k else rounded(v) for k, v in x.items()}
    return [rounded(v) for v in x] if isinstance(x, list | tuple) else x


def dumps(data: Mapping[str, Any]) -> str:
    """``data`` as JSON (floats :func:`rounded`), a line per top-level key and per record in lists (reviewable)."""
    lines = []
    for key, value in rounded(dict(data)).items():
        head = f"{json.dumps(key)}: "
        if isinstance(value, list) and value:
            body = ",\n  ".join(json.dumps(v, separators=(",", ":")) for v in value)
            lines.append(f"{head}[\n  {body}\n ]")
        else:
            lines.append(head + json.dumps(value, separators=(",", ":")))
    return "{\n " + ",\n ".join(lines) + "\n}\n"


#: the benchmark behind each results stem (the longest prefix wins): module under ``benchmarks``, class
BENCHMARKS = {
    "mirrored": ("mirrored.driver", "Mirrored"),
    "pipeline": ("pipeline.driver", "Pipeline"),
    "parameter_server": ("parameter_server.driver", "ParameterServer"),
    "load_balance": ("load_balance.driver", "LoadBalance"),
    "memory": ("memory.driver", "Memory"),
    "collectives": ("collectives.driver", "Collectives"),
    "sharding_engines": ("sharding_engines.driver", "ShardingEngines"),
    "faults": ("faults.driver", "Faults"),
    "cluster": ("cluster.driver", "Cluster"),
    "precision": ("precision.driver", "Precision"),
    "link_attribution": ("link_attribution.driver", "LinkAttribution"),
    "report_overhead": ("report_overhead.driver", "ReportOverhead"),
}
#: keys that are no figure: what the verdict rule sets, and a target's label
NOT_FIGURES = ("met", "verdict", "what")


def same_figures(fresh: Any, stored: Any) -> bool:
    """Whether every figure in ``stored`` is in ``fresh`` to ``DIGITS - 2`` digits (``fresh`` may add keys)."""
    if isinstance(stored, dict):
        return isinstance(fresh, dict) and all(
            k.endswith(NOT_FIGURES) or (k in fresh and same_figures(fresh[k], v)) for k, v in stored.items()
        )
    if isinstance(stored, list):
        return isinstance(fresh, list) and len(fresh) == len(stored) and all(map(same_figures, fresh, stored))
    if isinstance(stored, float) and isinstance(fresh, float):
        return math.isclose(fresh, stored, rel_tol=10.0 ** (2 - DIGITS))
    return fresh == stored
