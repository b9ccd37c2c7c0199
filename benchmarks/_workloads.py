"""The workloads moved to ``benchmarks/harness/workloads.py``; this name stays for ``precision.py`` until it moves."""

from benchmarks.harness.workloads import GPT_DEFAULTS, add_options, build, fill_defaults, label, spec_of

__all__ = ["GPT_DEFAULTS", "add_options", "build", "fill_defaults", "label", "spec_of"]
