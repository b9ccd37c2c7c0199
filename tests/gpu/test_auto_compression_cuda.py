"""``gradient_compression="auto"`` on NCCL, one GPU per rank: the link probe, and rank 0's choice kept on every rank
through forced switches. The worker and the checks are the CPU tests' (tests/comm/test_auto_compression.py), on NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.comm import test_auto_compression as on_gloo  # a module: its tests are not collected again here
from tests.gpu._cuda import needs_gpus
from tests.helpers import auto_workers
from tests.helpers.runner import free_port

pytestmark = pytest.mark.cuda


@pytest.mark.multiprocess
def test_auto_probes_nccl_and_every_rank_runs_rank_zeros_choice(tmp_path):
    needs_gpus(2)
    out = tmp_path / "run"
    mp.spawn(auto_workers.probe_then_switch, args=(2, free_port(), str(out), "nccl"), nprocs=2, join=True)
    runs = {
        kind: [torch.load(f"{out}.{kind}.rank{r}.pt", weights_only=True) for r in (0, 1)]
        for kind in ("probe", "switch")
    }
    # Positive latency and bandwidth for fp32 and fp16 and the compressions' compute, identical on both ranks.
    on_gloo.test_probe_on_loopback_gives_positive_figures_identical_on_both_ranks(runs)
    # Slow, fast, slow figures on rank 0 (the opposite on rank 1): the same decisions, steps and dtypes as on gloo.
    on_gloo.test_forced_switches_keep_every_rank_on_rank_zeros_choice(runs)
