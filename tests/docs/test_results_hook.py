"""The docs' results hook (docs/hooks/results.py) on a tiny results folder, and one strict build of a tiny site."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("mkdocs", reason="the docs extra is not installed (make docs installs it)")

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "docs" / "hooks" / "results.py"

MEASURED = {
    "format": "ds_lightning-bench/1",
    "provenance": {
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "uncommitted": [],
        "date": "2026-12-03T10:00:00+00:00",
        "cpu_model": "Test CPU 9000",
        "cores": 2,
        "torch": "2.13.0+cpu",
        "lightning": "2.6.6",
    },
    "summary": {
        "ds_mirrored": {
            "over_plain_ddp": {"median": 1.1127, "min": 0.849, "max": 1.13, "runs": [1.13, 0.849, 1.1127]},
            "bytes": 4505640,
            "label": "none",
            "missing": None,
        },
        "arms": ["a", "b"],
        "configs": [
            {"p": 2, "schedule": "GPipe", "m": 8, "ratio": 1.01},
            {"p": 2, "schedule": "1F1B", "m": 8, "ratio": 1.02},
            {"p": 4, "schedule": "1F1B", "m": 8, "ratio": 1.04},
            {"p": 4, "schedule": "1F1B", "m": 8, "ratio": 1.05},
        ],
    },
}
# Written before the harness recorded provenance: a commit and a start time, a core count, no CPU model or Lightning.
OLD = {"package": {"commit": "fedcba9876543210", "uncommitted": []}, "started": "2026-12-01T23:21:15+00:00", "cpus": 2}


@pytest.fixture(scope="module")
def hook() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("results_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture
def results(tmp_path: Path, hook: ModuleType):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "measured.json").write_text(json.dumps(MEASURED))
    (folder / "old.json").write_text(json.dumps(OLD))
    return hook.Results(folder)


def test_a_value_renders_with_its_format_scale_and_spread(hook, results):
    text = (
        'ratio {{ result("measured", "summary.ds_mirrored.over_plain_ddp.median", fmt=".3f") }}, '
        'spread {{ result("measured", "summary.ds_mirrored.over_plain_ddp", fmt=".2f") }}, '
        'median only {{result("measured.json", "summary.ds_mirrored.over_plain_ddp", spread=False)}}, '
        'MB {{ result("measured", "summary.ds_mirrored.bytes", scale=1e-6, fmt=".2f") }}, '
        'MiB {{ result("measured", "summary.ds_mirrored.bytes", scale="MiB", fmt=".2f") }}, '
        'percent {{ result("measured", ["summary", "ds_mirrored", "over_plain_ddp", "min"], fmt=".0%") }}, '
        'default {{ result("measured", "summary.ds_mirrored.over_plain_ddp.max") }} '
        '{{ result("measured", "summary.ds_mirrored.bytes") }}, '
        'index {{ result("measured", "summary.arms.1") }}, text {{ result("measured", "summary.ds_mirrored.label") }}'
    )
    out = hook.render(text, results)
    assert out.errors == []
    assert out.markdown == (
        "ratio 1.113, spread 1.11 [0.85 - 1.13], median only 1.11, MB 4.51, MiB 4.30, percent 85%,"
        " default 1.13 4.51e+06, index b, text none"
    )
    assert out.used == ["measured"]


def test_a_list_entry_is_selected_by_its_fields_not_its_position(hook, results):
    text = '{{ result("measured", "summary.configs.p=2,schedule=1F1B,m=8.ratio") }}'
    out = hook.render(text, results)
    assert out.errors == [] and out.markdown == "1.02"


def test_a_named_scale_turns_seconds_into_minutes(hook, results):
    text = '{{ result("measured", "summary.ds_mirrored.bytes", scale="minutes", fmt=".1f") }}'
    assert hook.render(text, results).markdown == f"{4505640 / 60:.1f}"


def test_a_ratio_of_two_figures_of_one_file(hook, results):
    text = '{{ ratio("measured", "summary.ds_mirrored.over_plain_ddp.min", "summary.ds_mirrored.bytes", fmt=".2e") }}'
    assert hook.render(text, results).markdown == f"{0.849 / 4505640:.2e}"
    bad = hook.render('{{ ratio("measured", "summary.ds_mirrored.label", "summary.ds_mirrored.bytes") }}', results)
    assert "key 'summary.ds_mirrored.label' is 'none', not a number" in bad.errors[0]


def test_references_in_code_are_left_alone(hook, results):
    text = '`{{ result("nowhere", "x") }}`\n\n```\n{{ result("nowhere", "x") }}\n```\n'
    out = hook.render(text, results)
    assert out.markdown == text and out.errors == [] and out.used == []


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ('result("absent", "summary")', "no results file .*absent.json; the results there: measured, old"),
        ('result("measured", "summary.ds_mirrored.nope")', "has no key 'nope' at summary.ds_mirrored .*over_plain_ddp"),
        ('result("measured", "summary.arms.7")', "'7' at summary.arms is not an index of its list of 2"),
        ('result("measured", "summary.configs.p=8.ratio")', "'p=8' matches 0 entries of its list, not one"),
        ('result("measured", "summary.configs.p=4,m=8.ratio")', "'p=4,m=8' matches 2 entries of its list, not one"),
        ('result("measured", "summary.ds_mirrored.missing")', "is null: the benchmark did not measure it"),
        ('result("measured", "summary.ds_mirrored")', "is a dict, not a figure"),
        ('result("measured", "summary.ds_mirrored.label", fmt=".2f")', "is 'none', not a number"),
        ('result("measured", "summary.ds_mirrored.bytes", digits=2)', "no option \\['digits'\\]"),
        ('result("measured")', "takes a results file and a key"),
        ('result("measured", "summary.ds_mirrored.bytes", scale="MiBs")', "scale='MiBs' is not a unit"),
        ("result(measured, x)", "give literals"),
    ],
)
def test_a_bad_reference_is_an_error_that_names_the_file_and_key(hook, results, reference, message):
    text = f"before {{{{ {reference} }}}} after"
    out = hook.render(text, results)
    assert out.markdown == text  # left as written, so the page shows what failed
    assert len(out.errors) == 1
    assert reference in out.errors[0]
    assert re.search(message, out.errors[0]), out.errors[0]


def test_provenance_shows_every_field_and_unrecorded_where_the_file_has_none(hook, results):
    assert results.provenance("measured") == {
        "commit": "0123456789",
        "date": "2026-12-03",
        "CPU": "Test CPU 9000",
        "cores": "2",
        "torch": "2.13.0+cpu",
        "Lightning": "2.6.6",
    }
    assert results.provenance("old") == {
        "commit": "fedcba9876",
        "date": "2026-12-01",
        "CPU": "unrecorded",
        "cores": "2",
        "torch": "unrecorded",
        "Lightning": "unrecorded",
    }
    inline = hook.render('{{ provenance("old") }}', results).markdown
    assert (
        inline == "(`old.json`: commit fedcba9876, date 2026-12-01, CPU unrecorded, cores 2, torch unrecorded,"
        " Lightning unrecorded)"
    )
    note = hook.provenance_note(results, ["measured", "old"])
    assert "| `measured.json` | 0123456789 | 2026-12-03 | Test CPU 9000 | 2 | 2.13.0+cpu | 2.6.6 |" in note
    assert "| `old.json` | fedcba9876 | 2026-12-01 | unrecorded | 2 | unrecorded | unrecorded |" in note


def test_uncommitted_changes_are_said(hook, tmp_path):
    dirty = {**MEASURED, "provenance": {**MEASURED["provenance"], "uncommitted": [" M ds_lightning/x.py"]}}
    (tmp_path / "dirty.json").write_text(json.dumps(dirty))
    assert hook.Results(tmp_path).provenance("dirty")["commit"] == "0123456789 + uncommitted changes"


def _site(root: Path, page: str, readme: str = "") -> subprocess.CompletedProcess[str]:
    """A one-page site that uses the hook on ``root/results``, built with ``mkdocs build --strict``."""
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "index.md").write_text(page)
    if readme:
        (root / "README.md").write_text(readme)
    (root / "mkdocs.yml").write_text(
        textwrap.dedent(
            f"""\
            site_name: t
            markdown_extensions: [admonition, tables]
            hooks: ["{HOOK}"]
            extra:
              results_dir: results
            """
        )
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def site(tmp_path: Path, results) -> Path:
    return tmp_path  # results live in tmp_path / "results"


def test_strict_build_renders_the_figure_and_the_provenance_note(site):
    done = _site(site, '# P\n\nThe ratio is {{ result("measured", "summary.ds_mirrored.over_plain_ddp.median") }}.\n')
    assert done.returncode == 0, done.stderr
    html = (site / "site" / "index.html").read_text()
    assert "The ratio is 1.11." in html
    assert "Where the figures on this page come from" in html and "Test CPU 9000" in html and "2.6.6" in html


def test_strict_build_fails_on_a_missing_key_naming_page_file_and_key(site):
    done = _site(site, '# P\n\n{{ result("measured", "summary.ds_mirrored.step_ms") }}\n')
    assert done.returncode != 0
    assert "docs/index.md" in done.stderr and "measured.json" in done.stderr and "'step_ms'" in done.stderr
    # control: the same site with a key that exists builds
    assert _site(site, '# P\n\n{{ result("measured", "summary.ds_mirrored.bytes") }}\n').returncode == 0


def test_strict_build_fails_on_a_reference_in_the_readme(site):
    done = _site(site, "# P\n", readme='# R\n\n{{ result("measured", "summary.ds_mirrored.bytes") }}\n')
    assert done.returncode != 0 and "README.md reads figures" in done.stderr


SUMMARY = {
    "verdicts": [
        {"benchmark": "measured", "what": "two_level/flat: step-time speed-up", "verdict": "missed"},
        {"benchmark": "measured", "what": "two_level/flat: inter-host bytes per step", "verdict": "met"},
        {"benchmark": "measured", "what": "step time at 100 Mbit/s (best: powersgd_r4)", "verdict": "within noise"},
        {"benchmark": "absent", "what": "anything", "verdict": "met"},
    ]
}


def test_a_verdict_is_read_from_the_bench_all_summary(hook, results):
    (results.folder / "bench_all.json").write_text(json.dumps(SUMMARY))
    text = (
        '{{ verdict("measured", "two_level/flat: step-time speed-up") }}, '
        '{{ verdict("measured", "two_level/flat: inter-host") }}, {{ verdict("measured", "step time at 100") }}'
    )
    out = hook.render(text, results)
    assert out.errors == []
    assert out.markdown == "missed, met, within noise"
    assert out.used == ["bench_all", "measured"]  # the provenance note names the summary and the benchmark's file


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ('verdict("nobench", "x")', "no verdicts of 'nobench' \\(it has: absent, measured\\)"),
        ('verdict("measured", "two_level/flat")', "matches 2 targets of 'measured'"),
        ('verdict("measured", "speed")', "matches no target of 'measured' in bench_all.json: two_level/flat: step"),
        ('verdict("absent", "anything")', "no results file .*absent.json"),
        ('verdict("measured")', "takes a benchmark name"),
    ],
)
def test_a_verdict_that_names_no_single_target_is_an_error(hook, results, reference, message):
    (results.folder / "bench_all.json").write_text(json.dumps(SUMMARY))
    out = hook.render(f"{{{{ {reference} }}}}", results)
    assert len(out.errors) == 1 and re.search(message, out.errors[0]), out.errors


def test_a_verdict_without_a_bench_all_summary_is_an_error(hook, results):
    out = hook.render('{{ verdict("measured", "two_level") }}', results)
    assert re.search("no results file .*bench_all.json", out.errors[0]), out.errors
