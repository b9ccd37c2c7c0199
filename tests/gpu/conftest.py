"""Every test here needs a CUDA device: without one it skips with the reason, or fails under ``make test-gpu``."""

from __future__ import annotations

import os

import pytest
import torch

# Set by `make test-gpu`: there, a machine without a visible CUDA device is an error, not a reason to skip.
REQUIRE_CUDA = "DS_LIGHTNING_REQUIRE_CUDA"


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if torch.cuda.is_available():
        return
    detail = (
        f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
    )
    if os.environ.get(REQUIRE_CUDA) == "1":
        pytest.fail(f"{REQUIRE_CUDA}=1 (make test-gpu) but no CUDA device is visible: {detail}", pytrace=False)
    pytest.skip(f"needs a CUDA device: {detail}; run `make test-gpu` on a GPU machine")
