"""ds_pipeline with two stages on CUDA (both on one GPU, or one per GPU): parity with one CPU process."""

from __future__ import annotations

import pytest
from torch.testing import assert_close

from tests.gpu._cuda import assert_learned, cpu_reference, gpus, launch

pytestmark = pytest.mark.cuda


@pytest.mark.multiprocess
def test_two_pipeline_stages_on_cuda_match_one_cpu_process(tmp_path):
    world = gpus()
    if world == 1:  # one process runs both stages (an interleaved schedule), on the one GPU
        options = {"schedule": "Interleaved1F1B", "n_microbatches": 4, "stages_per_rank": 2}
    else:  # one stage per GPU, activations sent over NCCL
        options = {"schedule": "1F1B", "n_microbatches": 4, "process_group_backend": "nccl"}
    spec = {"strategy": "ds_pipeline", "options": options, "accelerator": "cuda", "devices": world}
    ranks = launch(tmp_path, "pipeline", spec, ranks=world)
    reference = cpu_reference(tmp_path, replicas=1)  # stages split the model, not the batch
    for rank, result in enumerate(ranks):
        assert result["devices"] == [f"cuda:{rank}"], result["devices"]
        if world > 1:
            assert result["backend"] == "nccl"
    result = ranks[0]  # rank 0 gathers the whole model back after fit
    assert len(result["losses"]) == len(reference["losses"])
    assert_close(result["losses"], reference["losses"], atol=1e-4, rtol=1e-4)
    for name, value in reference["final"].items():
        assert_close(result["final"][name], value, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert_learned(result["losses"])
