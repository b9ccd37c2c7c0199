import os

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _isolate_process_state():
    """Restore environment variables and destroy any process group a test created."""
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
