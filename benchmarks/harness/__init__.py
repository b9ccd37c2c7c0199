"""The benchmark harness: experiment specs, interleaved launches, summaries, writers, one clock, one CLI; see
``benchmarks/README.md``."""

from .cli import RESULTS, Benchmark, main, stem
from .compact import series
from .provenance import cpu_model, provenance
from .run import REPO, Failed, error_line, launch, package_state, run_experiment, worker_env
from .spec import Arm, Experiment, interleave, round_order
from .summary import best_of, fmt, ok, paired, spread, summarise, values
from .verdict import MIN_LAUNCHES, VERDICTS, is_met, judged, verdict
from .writers import (
    FORMAT,
    Panel,
    bar_panels,
    judged_figure,
    markdown_table,
    read_json,
    verdict_lines,
    write_json,
    write_markdown,
)

__all__ = [
    "FORMAT",
    "MIN_LAUNCHES",
    "REPO",
    "RESULTS",
    "VERDICTS",
    "Arm",
    "Benchmark",
    "Experiment",
    "Failed",
    "Panel",
    "bar_panels",
    "best_of",
    "cpu_model",
    "error_line",
    "fmt",
    "interleave",
    "is_met",
    "judged",
    "judged_figure",
    "launch",
    "main",
    "markdown_table",
    "ok",
    "package_state",
    "paired",
    "provenance",
    "read_json",
    "round_order",
    "run_experiment",
    "series",
    "spread",
    "stem",
    "summarise",
    "values",
    "verdict",
    "verdict_lines",
    "worker_env",
    "write_json",
    "write_markdown",
]
