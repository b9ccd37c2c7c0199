import gc
import os

import pytest
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only

from tests.helpers import runner


@pytest.fixture(autouse=True)
def _isolate_process_state():
    """Restore environment variables and Lightning's rank-zero rank, and destroy any process group a test created.

    A strategy's ``set_world_ranks`` sets ``rank_zero_only.rank`` (one object for Lightning, Fabric and
    lightning_utilities) to its global rank: a test that plays rank 1 in the test process would otherwise leave every
    later test in that process on rank 1, where loggers write nothing (seen under pytest-xdist, whose workers run the
    tests in another order).
    """
    saved = dict(os.environ)
    rank = getattr(rank_zero_only, "rank", None)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
    if rank is not None:
        rank_zero_only.rank = rank


@pytest.fixture
def one_rank_group():
    """A one-process gloo group in the test's own process, destroyed after everything that used it.

    A DDP model (its reducer) freed after its group was destroyed joins the group's gloo threads and can wait on them
    forever in C++, where pytest's timeout cannot reach. The test's locals are gone by teardown; ``gc.collect()``
    frees the ones a reference cycle keeps, and only then is the group destroyed.
    """
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """Note the test's pytest timeout, whatever set it (ini, ``--timeout``, a mark), for the run helpers: a run's
    budget must be under it to ever apply (``tests.helpers.runner.check_budget``). pytest-timeout then arms it."""
    runner.set_test_timeout(settings.timeout)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item):
    runner.set_test_timeout(None)


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n`` (``--dist loadgroup``), the tests that build network-namespace clusters run on one worker,
    one at a time: each picks its subnet and names from what exists when it starts, so two at once could clash; and
    the tests reading one module-scoped launch (``compile_mirrored``) run on one worker, so it runs once.
    Without pytest-xdist (the version matrix's venvs) the mark is unknown, and nothing runs in parallel anyway."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if {"cluster_factory", "netns_required"} & fixtures:
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif "compile_mirrored" in fixtures:
            item.add_marker(pytest.mark.xdist_group("compile_mirrored"))
