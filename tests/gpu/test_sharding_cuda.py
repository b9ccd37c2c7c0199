"""ds_mirrored's sharding engines on CUDA over NCCL (ZeRO-1, FSDP2, ZeRO-3 with CPU offload): parity with one CPU
process under SGD with momentum, so that there is optimizer state to shard."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.gpu._cuda import assert_learned, cpu_reference, gpus, launch
from tests.helpers.mirrored_sharded_runs import ENGINES  # the engines the CPU sharded-checkpoint tests run

pytestmark = pytest.mark.cuda

MODEL = {"lr": 0.25, "momentum": 0.5}  # the step size of the other CUDA tests' plain SGD (lr 0.5), with state


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_sharded_ds_mirrored_on_cuda_matches_one_cpu_process(tmp_path, engine):
    world = gpus()
    options = {**ENGINES[engine], "process_group_backend": "nccl"}
    spec = {
        "strategy": "ds_mirrored",
        "options": options,
        "accelerator": "cuda",
        "devices": world,
        "model": MODEL,
        "save_params": True,  # FSDP2 and ZeRO-3 hold DTensor shards: gathered whole as training ends
    }
    ranks = launch(tmp_path, engine, spec, ranks=world)
    reference = cpu_reference(tmp_path, replicas=world, model=MODEL)
    finals = [torch.load(f"{tmp_path / engine}.params.rank{r}.pt", weights_only=True) for r in range(world)]
    offloaded = bool(ENGINES[engine].get("cpu_offload"))
    for rank, (result, final) in enumerate(zip(ranks, finals, strict=True)):
        assert result["backend"] == "nccl"
        assert result["world_size"] == final["world_size"] == world
        assert final["global_step"] == len(reference["losses"])
        # ZeRO-3's offloaded shards live in host memory between uses; every other engine keeps them on the rank's GPU.
        assert result["devices"] == (["cpu"] if offloaded else [f"cuda:{rank}"]), result["devices"]
        assert result["dtypes"] == ["torch.float32"]
        for name, value in final["state_dict"].items():  # every rank gathers the same whole parameters
            assert torch.equal(value, finals[0]["state_dict"][name]), name
    final = finals[0]["state_dict"]
    assert final.keys() == reference["final"].keys()
    for name, value in reference["final"].items():
        assert_close(final[name], value, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert_learned(ranks[0]["losses"])
