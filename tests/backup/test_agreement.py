"""``StepAgreement``: a flag raised by any rank reaches every rank at the same, next step, with no wait in the loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ds_lightning.backup.agreement import StepAgreement
from ds_lightning.testing import free_port
from tests.helpers import agreement_workers


def test_one_process_gets_its_own_flags_back_one_step_late() -> None:
    agreement = StepAgreement()
    assert agreement.collect(2) == (False, False)  # nothing started yet
    agreement.start((True, False), torch.device("cpu"), collective=False)
    assert agreement.collect(2) == (True, False)
    assert agreement.collect(2) == (False, False)  # collected once
    agreement.start((False, True), torch.device("cpu"), collective=False)
    agreement.reset()
    assert agreement.collect(2) == (False, False)


@pytest.mark.multiprocess
def test_a_flag_one_rank_raises_reaches_every_rank_at_the_same_next_step(tmp_path: Path) -> None:
    out = tmp_path / "agree"
    mp.spawn(agreement_workers.agree_over_steps, args=(3, free_port(), str(out)), nprocs=3, join=True)
    expected = [(False, False)] * 8
    expected[4] = (True, False)  # raised on rank 1 at step 3
    expected[6] = (False, True)  # raised on rank 2 at step 5
    for rank in range(3):
        result = torch.load(f"{out}.rank{rank}.pt", weights_only=False)
        assert result["seen"] == expected, (rank, result["seen"])
        assert result["grad"] == 3.0  # the interleaved all-reduces were not mixed up with the agreement's
