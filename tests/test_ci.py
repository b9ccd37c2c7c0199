"""The CI scripts (.ci/): the version matrix runs every smoke check, and ``.ci/run`` keeps its promises."""

from __future__ import annotations

import importlib.util
import re

from tests.helpers.runner import REPO


def _smoke_checks() -> set[str]:
    spec = importlib.util.spec_from_file_location("strategy_smoke", REPO / ".ci" / "strategy_smoke.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the checks; runs none
    return set(module.SMOKES)


def test_the_version_matrix_runs_every_smoke_check_at_each_end():
    script = (REPO / ".ci" / "versions").read_text()
    loop = re.search(r"for check in (.*?); do", script, re.DOTALL)
    assert loop is not None, "the loop over .ci/strategy_smoke.py's checks moved: update this test"
    assert set(loop.group(1).replace("\\\n", " ").split()) == _smoke_checks()
    features = {"ds_mirrored-zero", "ds_mirrored-fsdp2", "ds_mirrored-hierarchical", "ds_mirrored-auto"}
    assert features | {"backup-restore"} <= _smoke_checks()


def test_ci_run_prints_the_15_slowest_tests_and_fails_on_an_empty_collection():
    script = (REPO / ".ci" / "run").read_text()
    assert 'make test PYTEST_ARGS="--durations=15"' in script
    assert '"$rc" -eq 5' in script and "exit 1" in script.split('"$rc" -eq 5', 1)[1].split("fi", 1)[0]
