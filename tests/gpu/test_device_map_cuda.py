"""``ds_model_parallel`` with ``device_map`` on CUDA: submodules on cuda:0 and cuda:1, parity with the unsplit model.

The reference is the same model trained whole on cuda:0 (same kernels, so the tolerance stays at 1e-5). The
"cuda:0 only" cases run on one GPU (the hooks and the map, without a second device); the two-GPU cases skip with the
reason when fewer than two are visible.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ds_lightning.strategies.layer_split import LayerSplitStrategy
from tests.gpu._cuda import needs_gpus
from tests.helpers.controls import assert_far
from tests.helpers.device_map_runs import STEPS, fit

pytestmark = pytest.mark.cuda

TOL = {"atol": 1e-5, "rtol": 1e-5}
TIED_SPLIT = {
    "token": "cuda:0",
    "head": "cuda:0",  # tied to token: one Parameter, so one device
    "position": "cuda:0",
    "blocks.0": "cuda:0",
    "blocks.1": "cuda:1",
    "norm": "cuda:1",
}


def _devices(layout: str) -> list[str]:
    if layout == "cuda:0 and cuda:1":
        needs_gpus(2)
    return ["cuda:0", "cuda:1"] if layout == "cuda:0 and cuda:1" else ["cuda:0"]


def _assert_parity(run, reference):
    assert len(run.losses) == len(reference.losses) == STEPS
    assert_close(torch.stack(run.losses), torch.stack(reference.losses), **TOL)
    for name, value in run.final.items():
        assert_close(value, reference.final[name], **TOL, msg=name)
    assert_far(run.final, run.initial, 1e-3, "the weights before training")
    assert run.loss_devices == {"cuda:0"}  # the loss comes back to the root device
    # The optimizer was built after placement: each state tensor lives with its parameter.
    for name, devices in run.state_devices.items():
        assert devices == {run.param_devices[name]}, name


@pytest.mark.parametrize("layout", ["cuda:0 only", "cuda:0 and cuda:1"])
def test_tied_gpt_explicit_map_on_cuda_matches_the_unsplit_model(layout):
    devices = _devices(layout)
    mapping = {k: (v if v in devices else devices[-1]) for k, v in TIED_SPLIT.items()}
    reference = fit("tied_gpt", accelerator="gpu")
    strategy = LayerSplitStrategy(devices=devices, device_map=mapping)
    run = fit("tied_gpt", strategy, accelerator="gpu")
    _assert_parity(run, reference)
    assert run.param_devices["net.blocks.1.attn.qkv.weight"] == devices[-1]
    assert run.param_devices["net.token.weight"] == "cuda:0"
    assert run.model.net.head.weight is run.model.net.token.weight
    assert strategy.device_hook_calls == dict.fromkeys(["", *mapping], STEPS)


@pytest.mark.parametrize("kind", ["tied_gpt", "hf_gpt2"])
def test_auto_on_two_gpus_uses_both_and_matches_the_unsplit_model(kind):
    devices = _devices("cuda:0 and cuda:1")
    reference = fit(kind, accelerator="gpu")
    strategy = LayerSplitStrategy(devices=devices, device_map="auto")
    run = fit(kind, strategy, accelerator="gpu")
    _assert_parity(run, reference)
    assert strategy.device_map_used is not None
    assert set(strategy.device_map_used.values()) == set(devices), strategy.device_map_used
    assert set(run.param_devices.values()) == set(devices)
