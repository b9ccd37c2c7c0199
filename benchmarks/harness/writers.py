"""What a benchmark writes: the JSON of its records, a markdown table, a PNG chart (matplotlib, a dev dependency)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .compact import dumps
from .figures import save_figure
from .summary import fmt

#: Written into every JSON; ``--render`` reads only JSON carrying it (older results must be run again).
FORMAT = "ds_lightning-bench/1"


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` with the format tag, a line per record (:func:`compact.dumps`: reviewable, and small)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps({"format": FORMAT, **data}))


def read_json(path: Path) -> dict[str, Any]:
    """A JSON written by :func:`write_json`; SystemExit when it is missing or has no ``format`` (run it again)."""
    if not path.exists():
        raise SystemExit(f"--render: {path} does not exist; run the benchmark first, or name the JSON: --render PATH")
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise SystemExit(
            f"--render: {path} has format {data.get('format')!r}, not {FORMAT!r} (written before the benchmark"
            " harness); its records cannot be re-read: run the benchmark again to get a JSON --render can read."
        )
    return data


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A GitHub markdown table; cells are ``str()``-ed, pipes in them escaped."""
    if any(len(row) != len(headers) for row in rows):
        raise ValueError(f"every row needs {len(headers)} cells ({list(headers)}); got {[len(r) for r in rows]}")

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(headers), "|" + "---|" * len(headers), *(line(r) for r in rows)]


def judged_figure(entry: Mapping[str, Any]) -> str:
    """A ``summary["verdicts"]`` entry's figure: ``median [min - max]`` to three significant digits, ``-`` for none."""
    if entry.get("median") is None:
        return "-"
    median, low, high = (f"{entry[k]:.3g}" for k in ("median", "min", "max"))
    return median if low == high == median else f"{median} [{low} - {high}]"


def verdict_lines(verdicts: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The section every results page ends with: each target of ``summary["verdicts"]`` (:func:`harness.judged`)."""
    if verdicts is None:  # a summary from before the uniform verdicts
        return []
    head = [
        "",
        "## Verdicts",
        "",
        "Every target of this benchmark, as `make bench-all` collects them (`summary.verdicts` in the JSON): the"
        " median over launches [min - max], judged by the harness's rule (met when the median meets the target,"
        " within noise when the spread reaches it, not judged under 3 launches).",
        "",
    ]
    if not verdicts:
        return [*head, "This benchmark states no target: its figures are a reference (see its README)."]
    rows = [[v["what"], v["target"], judged_figure(v), v["launches"], v["verdict"]] for v in verdicts]
    return [*head, *markdown_table(["what", "target", "median [min - max]", "launches", "verdict"], rows)]


def write_markdown(path: Path, lines: Sequence[str], echo: bool = True) -> None:
    """The lines as one markdown file; printed too with ``echo``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    if echo:
        print(text, end="", flush=True)


@dataclass(frozen=True)
class Panel:
    """One bar chart of ``summary[arm][key]`` (a spread) per arm with min-max bars, each bar labelled with the
    median of ``summary[arm][ratio_key]`` when given."""

    key: str
    ylabel: str
    ratio_key: str = ""
    log: bool = False


def bar_panels(
    path: Path,
    summary: Mapping[str, Mapping[str, Any]],
    panels: Sequence[Panel],
    title: str = "",
    colors: Mapping[str, str] | None = None,
) -> None:
    """One PNG: a bar chart per panel, the arms side by side (medians, min-max bars, ratio labels)."""
    import matplotlib  # imported here: rendering is optional for running a benchmark's workers

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        arms = [a for a in summary if summary[a].get(panel.key)]
        med = [summary[a][panel.key]["median"] for a in arms]
        lo = [m - summary[a][panel.key]["min"] for a, m in zip(arms, med, strict=True)]
        hi = [summary[a][panel.key]["max"] - m for a, m in zip(arms, med, strict=True)]
        color = [(colors or {}).get(a, f"C{i}") for i, a in enumerate(arms)]
        ax.bar(range(len(arms)), med, yerr=[lo, hi], capsize=4, color=color)
        for i, arm in enumerate(arms):
            ratio = summary[arm].get(panel.ratio_key) if panel.ratio_key else None
            if ratio:
                top = summary[arm][panel.key]["max"]
                ax.annotate(f"{fmt(ratio, '.2f').split(' ')[0]}x", (i, top), ha="center", va="bottom", fontsize=8)
        # more than a few arm names side by side run into each other: slant them
        slant = {"rotation": 30, "ha": "right"} if len(arms) > 4 else {}
        ax.set_xticks(range(len(arms)), arms, fontsize=8, **slant)
        ax.set_ylabel(panel.ylabel, fontsize=9)
        if panel.log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
