"""Every result the harness writes records where it was measured, and the docs' hook shows all of it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import lightning
import pytest
import torch

from benchmarks import harness
from benchmarks.harness import Arm, Experiment

REPO = Path(__file__).resolve().parents[2]


class Tiny(harness.Benchmark):
    name = "tiny"
    defaults = {"repeats": 1}
    quick = {"repeats": 1}

    def experiment(self, opts):
        return Experiment([Arm("a")], opts.repeats)

    def run(self, arm, repeat, opts):
        return {"ms": 1.0}

    def summarise(self, data):
        return harness.summarise(data["records"], list(data["arms"]), ["ms"])

    def report(self, data):
        return ["# tiny"]


def test_the_harness_records_commit_date_machine_and_versions(tmp_path: Path):
    harness.main(Tiny(), ["--quick", "--out", str(tmp_path)])
    prov = json.loads((tmp_path / "tiny.json").read_text())["provenance"]
    assert len(prov["commit"]) == 40  # this checkout is a git repository
    assert prov["date"][:4].isdigit() and "T" in prov["date"]
    assert prov["cores"] >= 1 and prov["cpu_model"]
    assert prov["torch"] == torch.__version__ and prov["lightning"] == lightning.__version__
    assert isinstance(prov["uncommitted"], list)


def test_cpu_model_reads_proc_cpuinfo(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Test CPU 9000 @ 3.0GHz\nflags\t: avx2\n")
    assert harness.cpu_model(info) == "Test CPU 9000 @ 3.0GHz"


def test_the_docs_show_every_field_the_harness_recorded(tmp_path: Path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (make docs installs it)")
    harness.main(Tiny(), ["--quick", "--out", str(tmp_path)])
    spec = importlib.util.spec_from_file_location("results_hook_provenance", REPO / "docs" / "hooks" / "results.py")
    hook = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = hook
    try:
        spec.loader.exec_module(hook)
        shown = hook.Results(tmp_path).provenance("tiny")
    finally:
        sys.modules.pop(spec.name, None)
    assert hook.UNRECORDED not in shown.values(), shown
    assert shown["Lightning"] == lightning.__version__ and shown["torch"] == torch.__version__
