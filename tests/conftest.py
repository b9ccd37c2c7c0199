import gc
import os

import pytest
import torch.distributed as dist

from tests.helpers import runner


@pytest.fixture(autouse=True)
def _isolate_process_state():
    """Restore environment variables and destroy any process group a test created."""
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


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
    one at a time: each picks its subnet and names from what exists when it starts, so two at once could clash.
    Without pytest-xdist (the version matrix's venvs) the mark is unknown, and nothing runs in parallel anyway."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if {"cluster_factory", "netns_required"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("netns"))
