"""Compact results: per-step series summarised into quantiles, and a JSON layout of one line per record.

``python -m benchmarks.harness.compact FILE...`` rewrote the results written before the harness compacted them
(their summaries, and every figure a summary is computed from, unchanged).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["dumps", "series"]


def series(xs: Iterable[float | None]) -> dict[str, Any] | None:
    """A per-step series as its size, median, quartiles and range (what a run's figures and charts read)."""
    v = [float(x) for x in xs if x is not None]
    if not v:
        return None
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0],) * 3
    return {"n": len(v), "median": statistics.median(v), "q1": q1, "q3": q3, "min": min(v), "max": max(v)}


#: significant digits a float keeps in the JSON: far finer than any clock or counter here resolves (a step time to
#: the nanosecond, a ratio to 1e-9), and about a fifth of the file smaller than the 17 digits of ``repr``
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
    """``data`` as JSON (floats :func:`rounded`), one line per top-level key, and one line per record inside lists
    (reviewable and small)."""
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
}
#: keys that are no figure: what the verdict rule sets, and a target's label
NOT_FIGURES = ("met", "verdict", "what")


def same_figures(fresh: Any, stored: Any) -> bool:
    """Whether every figure in ``stored`` is in ``fresh`` (to ``DIGITS - 2`` significant digits; ``fresh`` may add keys,
    judge and label anew)."""
    if isinstance(stored, dict):
        return isinstance(fresh, dict) and all(
            k.endswith(NOT_FIGURES) or (k in fresh and same_figures(fresh[k], v)) for k, v in stored.items()
        )
    if isinstance(stored, list):
        return isinstance(fresh, list) and len(fresh) == len(stored) and all(map(same_figures, fresh, stored))
    if isinstance(stored, float) and isinstance(fresh, float):
        return math.isclose(fresh, stored, rel_tol=10.0 ** (2 - DIGITS))
    return fresh == stored


def rewrite(path: Path) -> str:
    """Compact one results JSON; its summary becomes today's where that has the same figures (the verdicts by today's
    rule), else the stored one stays (written by older code). What happened, in a line."""
    import importlib

    stem = max((n for n in BENCHMARKS if path.stem.startswith(n)), key=len)
    module, cls = BENCHMARKS[stem]
    bench = getattr(importlib.import_module(f"benchmarks.{module}"), cls)()
    before = path.stat().st_size
    data = bench.compact(json.loads(path.read_text()))
    stored = data.get("summary")
    fresh = json.loads(json.dumps(bench.summarise(data), default=str))
    same = same_figures(fresh, stored)
    data["summary"] = fresh if same else stored
    path.write_text(dumps(data))
    kept = "summary re-judged" if same else "summary kept as stored (older code's figures differ)"
    return f"{path.name}: {before / 1e3:.0f} kB -> {path.stat().st_size / 1e3:.0f} kB, {kept}"


def main(argv: list[str]) -> None:
    """The one-off compaction of existing results files."""
    for name in argv:
        print(rewrite(Path(name)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
