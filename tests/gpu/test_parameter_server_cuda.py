"""A ds_parameter_server worker training on CUDA (the servers stay on CPU): bulk synchronous equals one process."""

from __future__ import annotations

import pytest
from torch.testing import assert_close

from tests.gpu._cuda import assert_learned, cpu_reference, gpus, launch

pytestmark = pytest.mark.cuda


@pytest.mark.multiprocess
def test_a_cuda_worker_pushes_and_pulls_through_a_cpu_server_like_one_process(tmp_path):
    world = gpus()
    options = {"num_servers": 1, "max_staleness": 0}  # bulk synchronous: the numerics of one process
    spec = {"strategy": "ds_parameter_server", "options": options, "accelerator": "cuda", "devices": world}
    ranks = launch(tmp_path, "ps", spec, ranks=world)
    reference = cpu_reference(tmp_path, replicas=world)
    for rank, result in enumerate(ranks):
        assert result["devices"] == [f"cuda:{rank}"], result["devices"]  # the worker's model lives on its GPU
        assert result["global_step"] == len(reference["losses"])
    result = ranks[0]
    for name, value in reference["final"].items():
        assert_close(result["final"][name], value, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert_learned(result["losses"])
