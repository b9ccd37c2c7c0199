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


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """Note the test's pytest timeout, whatever set it (ini, ``--timeout``, a mark), for the run helpers: a run's
    budget must be under it to ever apply (``tests.helpers.runner.check_budget``). pytest-timeout then arms it."""
    runner.set_test_timeout(settings.timeout)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item):
    runner.set_test_timeout(None)
