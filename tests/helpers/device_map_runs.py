"""Trainings for the ``device_map`` tests: the two non-Sequential models, random byte batches, what each step did.

Shared by the CPU tests (tests/strategies/test_layer_split_device_map.py) and the CUDA ones (tests/gpu/): the same
model, data and steps with and without ``LayerSplitStrategy(device_map=...)``, so parity is one comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from ds_lightning.demos import TiedGPT

__all__ = ["BLOCK", "STEPS", "Run", "build", "byte_batches", "fit"]

BLOCK = 16  # tokens per row
BATCH = 8
STEPS = 4
LR = 1e-2  # large enough that 4 AdamW steps move every weight far beyond the 1e-5 of the parity checks


def byte_batches(rows: int = BATCH * STEPS, seed: int = 1) -> TensorDataset:
    """``(x, y)`` int64 byte ids ``(rows, BLOCK)``, random but fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randint(0, 256, (rows, BLOCK), generator=g), torch.randint(0, 256, (rows, BLOCK), generator=g)
    )


def build(kind: str) -> pl.LightningModule:
    """A fresh model with fixed initial weights: ``"tied_gpt"`` (ours) or ``"hf_gpt2"`` (transformers')."""
    torch.manual_seed(0)
    if kind == "tied_gpt":
        return TiedGPT(n_layer=2, n_head=2, d_model=32, block_size=BLOCK, lr=LR)
    if kind == "hf_gpt2":
        from tests.helpers.hf_models import HFGPT2  # transformers is imported only by the tests that use it

        return HFGPT2(n_layer=2, n_head=2, d_model=32, block_size=BLOCK, lr=LR)
    raise ValueError(f"kind={kind!r}: 'tied_gpt' or 'hf_gpt2'")


@dataclass
class Run:
    """One training's results, every tensor on the CPU."""

    model: pl.LightningModule
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    losses: list[torch.Tensor] = field(default_factory=list)
    #: Device of each parameter (by name) and of each optimizer state tensor (by parameter name), after step 1.
    param_devices: dict[str, str] = field(default_factory=dict)
    state_devices: dict[str, set[str]] = field(default_factory=dict)
    loss_devices: set[str] = field(default_factory=set)


class _Record(Callback):
    def __init__(self, run: Run) -> None:
        self.run = run

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"]
        self.run.losses.append(loss.detach().cpu())
        self.run.loss_devices.add(str(loss.device))
        if self.run.param_devices:
            return
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.run.param_devices = {n: str(p.device) for n, p in pl_module.named_parameters()}
        optimizer = trainer.optimizers[0]
        for param, state in optimizer.state.items():
            self.run.state_devices[names[id(param)]] = {
                str(v.device) for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"
            }


def fit(
    kind: str,
    strategy: Any = None,
    *,
    accelerator: str = "cpu",
    steps: int = STEPS,
    batches: int | None = None,
    ckpt_path: str | None = None,
    callbacks: list[Callback] | None = None,
) -> Run:
    """Train ``build(kind)`` for ``steps`` batches of :func:`byte_batches`, under ``strategy`` or on one device.

    ``batches``: batches per epoch (default ``steps``: one epoch); ``ckpt_path``: resume from it; ``callbacks`` run
    too, and checkpointing is on when they are given.
    """
    model = build(kind)
    run = Run(model, {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}, {})
    options: dict[str, Any] = {"strategy": strategy} if strategy is not None else {"devices": 1}
    trainer = pl.Trainer(
        accelerator=accelerator,
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[_Record(run), *(callbacks or [])],
        **options,
    )
    data = byte_batches(BATCH * (batches or steps))
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=False), ckpt_path=ckpt_path)
    run.final = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
    return run
