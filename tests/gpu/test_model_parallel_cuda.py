"""ds_model_parallel on CUDA: stages on cuda:0 (and cuda:1 where present), parity with one CPU process."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry
from torch.testing import assert_close
from torch.utils.data import DataLoader

from tests.gpu._cuda import BATCH, STEPS, assert_learned, cpu_reference, needs_gpus
from tests.gpu._runs import Net, make_data

pytestmark = pytest.mark.cuda


class _StageDevices(Callback):
    """The device of every split layer's parameters, while the model is split (after the first batch)."""

    def __init__(self) -> None:
        self.devices: dict[str, str] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.devices:
            self.devices = {name: str(p.device) for name, p in pl_module.named_parameters()}


@pytest.mark.parametrize("stages", ["cuda:0 twice", "cuda:0 and cuda:1"])
def test_ds_model_parallel_on_cuda_matches_one_cpu_process(tmp_path, stages):
    if stages == "cuda:0 and cuda:1":
        needs_gpus(2)
    devices = ["cuda:0", "cuda:0"] if stages == "cuda:0 twice" else ["cuda:0", "cuda:1"]
    entry = StrategyRegistry["ds_model_parallel"]
    strategy = entry["strategy"](**{**entry["init_params"], "devices": devices, "n_microbatches": 4})
    pl.seed_everything(0, verbose=False)
    model = Net()
    where = _StageDevices()
    trainer = pl.Trainer(
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[where],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(make_data(), batch_size=BATCH, shuffle=False))
    reference = cpu_reference(tmp_path)
    # Two stages of the five layers: the first layer on the first device, the head on the last.
    assert where.devices["net.0.weight"] == devices[0]
    assert where.devices["net.4.weight"] == devices[-1]
    assert set(where.devices.values()) == set(devices)
    assert_close(model.losses, reference["losses"], atol=1e-4, rtol=1e-4)
    for name, value in reference["final"].items():
        assert_close(model.state_dict()[name].cpu(), value, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert_learned(model.losses)
