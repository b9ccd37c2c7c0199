"""MixedPrecision on CUDA: what ``auto`` measures and picks, the autocast dtype, the CUDA GradScaler, and learning."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from ds_lightning.callbacks import MixedPrecision
from ds_lightning.callbacks._precision_probe import candidates_for
from tests.gpu._cuda import BATCH, STEPS, assert_learned, cpu_reference
from tests.gpu._runs import Net, make_data

pytestmark = pytest.mark.cuda

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Probe(Net):
    """Records, per training step, autocast's state and the dtype a layer returns; can overflow one step.

    auto's timing passes call ``training_step`` too; the step's own call is the last before the batch ends.
    """

    def __init__(self, inf_at_step: int | None = None) -> None:
        super().__init__()
        self.inf_at_step = inf_at_step
        self.seen: list[tuple[bool, torch.dtype]] = []
        self._last: tuple[bool, torch.dtype] | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        self._last = (torch.is_autocast_enabled("cuda"), self.net[0](x).dtype)
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step == self.inf_at_step else loss

    def on_train_batch_start(self, *args: Any) -> None:
        del self.losses[len(self.seen) :]  # runs after the callbacks' hook: drops the timing passes' losses

    def on_train_batch_end(self, *args: Any) -> None:
        assert self._last is not None
        self.seen.append(self._last)


def _fit(tmp_path, amp: MixedPrecision, model: _Probe, *more: pl.Callback) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[amp, *more],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(make_data(), batch_size=BATCH, shuffle=False))
    return trainer


@pytest.mark.parametrize("precision", ["auto", "bf16", "fp16"])
def test_mixed_precision_on_cuda_autocasts_in_the_chosen_dtype_and_learns(tmp_path, precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name()} has no native bf16")
    amp = MixedPrecision(precision, init_scale=1024.0)  # far from fp16's limit: no step of this model overflows
    model = _Probe()
    trainer = _fit(tmp_path, amp, model)
    expected = precision
    if precision == "auto":  # what it measured on this GPU: every candidate timed, the same rule applied
        assert amp.decision is not None
        device = torch.device("cuda", torch.cuda.current_device())
        assert set(amp.decision.median_ms) == set(candidates_for(device)) >= {"fp32", "fp16"}
        expected = amp.decision.chosen
    assert amp.chosen == expected
    assert model.seen == [(expected != "fp32", DTYPES[expected])] * STEPS
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the weights stay fp32
    if expected == "fp32":
        assert amp.plugin is None and type(trainer.precision_plugin).__name__ == "Precision"
    else:
        assert trainer.precision_plugin is amp.plugin and amp.plugin.device == "cuda"
    scaler = amp.plugin.scaler if amp.plugin is not None else None
    if expected == "fp16":
        assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
        assert scaler._scale is not None and scaler._scale.device.type == "cuda"  # created on the GPU by its use
        assert scaler.get_scale() == 1024.0 and amp.skipped_steps == 0  # no overflow, no growth in 16 steps
    else:
        assert scaler is None  # bf16 has fp32's range: no scaling
    # Low precision moves the numbers a little, not the learning: within 1% of fp32 on a CPU, step by step
    # (bf16 on a CPU: 0.13% at most).
    reference = cpu_reference(tmp_path)
    torch.testing.assert_close(model.losses, reference["losses"], atol=0.01, rtol=0.01)
    assert_learned(model.losses)


class _Moves(pl.Callback):
    """Per training step: did any parameter move, and are all of them finite."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.moved: list[bool] = []
        self.finite: list[bool] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        after = list(pl_module.parameters())
        self.moved.append(any(not torch.equal(a, b) for a, b in zip(self.before, after, strict=True)))
        self.finite.append(all(bool(torch.isfinite(p).all()) for p in after))


def test_fp16_on_cuda_skips_an_overflowing_step_with_the_cuda_grad_scaler(tmp_path):
    amp = MixedPrecision("fp16", init_scale=1024.0)
    moves = _Moves()
    _fit(tmp_path, amp, _Probe(inf_at_step=3), moves)
    assert amp.chosen == "fp16"
    assert amp.skipped_steps == 1
    assert moves.moved == [step != 3 for step in range(STEPS)]  # only the overflowing step left the weights alone
    assert all(moves.finite)
    scaler = amp.plugin.scaler
    assert scaler._scale is not None and scaler._scale.device.type == "cuda"  # created on the GPU by its first use
    assert scaler.get_scale() == 512.0  # backed off once
