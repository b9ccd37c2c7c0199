"""The run helpers' own checks (tests/helpers/runner.py), without training: every rank's exit code is kept and can be
asserted, and a run's time budget must be under the running test's pytest timeout to ever apply."""

from __future__ import annotations

import pytest

from tests.helpers.runner import Run, WarmRanks, run_module, run_ranks

EXIT = "tests.helpers.exit_code"  # exits with the code given for its rank


def test_every_rank_exits_42_fails_when_only_rank_0_does() -> None:
    run = run_ranks(EXIT, ["42", "0"], 2, timeout=60)
    assert run.returncodes == [42, 0]
    assert run.returncode == 42  # the summary alone (all the tests once asserted) would pass
    with pytest.raises(AssertionError, match=r"every rank to exit with 42, got \[42, 0\]"):
        run.assert_every_rank_exits(42)


def test_every_rank_exits_42_passes_when_each_does() -> None:
    run_ranks(EXIT, ["42", "42"], 2, timeout=60).assert_every_rank_exits(42)


def test_a_failing_rank_behind_a_successful_rank_0_is_the_summary_and_is_seen() -> None:
    run = run_ranks(EXIT, ["0", "3"], 2, timeout=60)
    assert (run.returncode, run.returncodes) == (3, [0, 3])
    with pytest.raises(AssertionError, match=r"got \[0, 3\]"):
        run.assert_every_rank_exits(0)


def test_warm_ranks_keep_every_ranks_code() -> None:
    with WarmRanks(2, preload=("json",)) as ranks:  # imports nothing heavy: the runner's logic only
        run = ranks.run(EXIT, ["42", "0"], timeout=60)
        assert run.returncodes == [42, 0]
        with pytest.raises(AssertionError, match=r"got \[42, 0\]"):
            run.assert_every_rank_exits(42)
        ranks.run(EXIT, ["5", "5"], timeout=60).assert_every_rank_exits(5)


def test_one_process_is_one_code() -> None:
    run = run_module(EXIT, ["7"], timeout=60)
    assert run.returncodes == [7]
    run.assert_every_rank_exits(7)
    assert Run(0, "", 0.0).returncodes == [0]


@pytest.mark.timeout(40)
def test_a_run_budget_not_under_the_tests_pytest_timeout_fails_before_it_starts() -> None:
    """pytest-timeout would stop this test at 40 s, so a 40 s budget could never apply; 39 s can."""
    for budget in (40, 400):
        with pytest.raises(AssertionError, match=rf"timeout={budget} s is not under this test's pytest timeout of 40"):
            run_module(EXIT, ["0"], timeout=budget)
        with pytest.raises(AssertionError, match="pytest timeout of 40 s"):
            run_ranks(EXIT, ["0", "0"], 2, timeout=budget)
    run_module(EXIT, ["0"], timeout=39).assert_every_rank_exits(0)


def test_the_suites_own_timeout_bounds_a_run_budget() -> None:
    """No mark: pyproject's ``timeout = 300`` is the one that counts."""
    with pytest.raises(AssertionError, match="pytest timeout of 300 s"):
        run_module(EXIT, ["0"], timeout=420)
