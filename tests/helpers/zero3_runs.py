"""Plain ds_mirrored against ``shard_parameters=True`` (ZeRO-3 on fsdp2) on two GPTs with tied weights.

Usage: ``python -m tests.helpers.zero3_runs OUT SUITE``, started once per rank (``tests.helpers.runner.run_ranks``);
one launch fits every arm of ``SUITE`` in turn on the same process group, at whatever world size it was started:

- ``parity``: for each model (:func:`tied_gpt`, ds_lightning's ``TiedGPT``; :func:`hf_gpt2`, transformers' GPT-2),
  AdamW for :data:`STEPS` steps as ``plain``, ``zero3`` (``shard_parameters=True``) and ``offload`` (with
  ``cpu_offload=True``); at 2 ranks also the tied model on the fsdp2 engine without parameter sharding (``fsdp2``);
- ``compose``: the tied model plain and ``zero3`` under Lightning's ``accumulate_grad_batches=2`` with validation
  every 2 steps (``accum-*``, with
  :class:`~tests.helpers.callbacks.RecordGradientSync` on zero3's, into ``OUT/accum-syncs.rank{R}.json``), under
  manual optimization with gradient clipping (``manual-*``) and under ``precision="bf16-mixed"`` (``bf16-*``).

Each arm ``<model>-<arm>`` writes ``OUT/<name>.rank{R}.pt`` (:class:`~tests.helpers.callbacks.SaveParams`: the whole
final parameters) and ``OUT/<name>.rank{R}.json`` (what :class:`Probe` saw).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from ds_lightning.demos import TiedGPT
from ds_lightning.sharding import local_state_bytes
from ds_lightning.strategies import MirroredStrategy
from tests.helpers.callbacks import RecordGradientSync, SaveParams
from tests.helpers.hf_models import HFGPT2

STEPS, BATCH, LENGTH = 4, 4, 16  # per rank: 4 optimizer steps of 4 sequences of 16 bytes
# 4 AdamW steps move every weight by about 4 * LR, far beyond the parity tolerance (1e-5). Not larger: attention's key
# bias has no gradient in exact arithmetic (softmax ignores a shift shared by every key), so its fp32 gradient is
# rounding noise that depends on the order the ranks' gradients are summed in (DDP's all-reduce against FSDP2's
# reduce-scatter), and Adam, which divides by the gradient's own scale, turns that noise into steps that grow with LR
# (measured at 4 ranks: 1.5e-5 apart at LR = 1e-2).
LR = 1e-3
ARMS = {
    "plain": {},
    "zero3": {"shard_parameters": True},
    "offload": {"shard_parameters": True, "cpu_offload": True},
    "fsdp2": {"shard_optimizer_state": True, "sharding_engine": "fsdp2"},  # sharded optimizer, whole parameters
}


def tied_gpt() -> TiedGPT:
    """nanoGPT's layout: token and position embeddings, a ModuleList of 2 blocks, a head tied to the token embedding."""
    return TiedGPT(n_layer=2, n_head=2, d_model=32, block_size=LENGTH, lr=LR)


def hf_gpt2() -> HFGPT2:
    """transformers' GPT2LMHeadModel (2 GPT2Blocks, ``lm_head`` tied to ``wte``), built from a config."""
    return HFGPT2(n_layer=2, n_head=2, d_model=32, block_size=LENGTH, lr=LR)


class ManualTiedGPT(TiedGPT):
    """The tied model under manual optimization: zero_grad, manual_backward, clip by norm, step."""

    def __init__(self) -> None:
        super().__init__(n_layer=2, n_head=2, d_model=32, block_size=LENGTH, lr=LR)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = self.pipeline_loss(self.net(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        return loss


MODELS = {"tied": tied_gpt, "hf": hf_gpt2, "manual": ManualTiedGPT}
BLOCKS = {"tied": "net.blocks.1", "hf": "net.transformer.h.1", "manual": "net.blocks.1"}  # a unit under zero3
TIES = {  # the two names of each model's one tied parameter (embedding and head)
    "tied": ("net.token.weight", "net.head.weight"),
    "hf": ("net.transformer.wte.weight", "net.lm_head.weight"),
    "manual": ("net.token.weight", "net.head.weight"),
}


def data(world: int, steps: int = STEPS) -> DataLoader:
    """Random byte sequences, ``y`` the next byte of ``x``: the same batches in every arm (Lightning's distributed
    sampler gives each rank its own)."""
    tokens = torch.randint(0, 256, (world * steps * BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Probe(Callback):
    """What one rank holds and computes, written as JSON to ``{path}.rank{R}.json`` at the end of fit:

    - ``losses``: this rank's loss at every batch, and ``val_losses``: the validation loss of each validation run;
    - ``state_bytes``: :func:`~ds_lightning.sharding.local_state_bytes` after the last optimizer step (the local
      parameters, gradients and optimizer state), and ``whole_bytes``: the same for an unsharded replica, counted
      from the whole parameters (fp32 parameters and gradients, AdamW's two moments, a 4-byte step per tensor);
    - ``gathered_after_forward``: the fraction of the parameters (by count) held whole when the backward starts;
    - ``block_dtype``: the dtype of ``block``'s parameters inside its forward (what the all-gather delivered);
    - ``param_devices``, ``state_devices``, ``grad_dtypes``, ``dtensor``: where and how the local shards live;
    - ``offload_policies``, ``gather_dtypes``, ``units``: the policies and number of the fully_shard units;
    - ``tied``: whether the embedding and the head still hold one parameter at the end.
    """

    def __init__(self, path: Path, block: str, tie: tuple[str, str]) -> None:
        self.path, self.block, self.tie = path, block, tie
        self.record: dict[str, Any] = {"losses": []}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The policies each fully_shard unit runs under (FSDP2 keeps them on its parameter groups; read only here).
        groups = [
            g for m in pl_module.modules() if isinstance(m, FSDPModule) for g in fully_shard.state(m)._fsdp_param_groups
        ]
        self.record["offload_policies"] = sorted({type(g.offload_policy).__name__ for g in groups})
        self.record["gather_dtypes"] = sorted({str(g.mp_policy.param_dtype) for g in groups})
        self.record["units"] = len(groups)
        block = pl_module.get_submodule(self.block)

        def seen(module: torch.nn.Module, args: Any) -> None:
            self.record["block_dtype"] = str(next(module.parameters()).dtype)

        block.register_forward_pre_hook(seen)  # fully_shard's own pre-hook (prepended) has gathered by now

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        params = list(pl_module.parameters())
        whole = sum(p.numel() for p in params if not isinstance(p, DTensor))
        self.record["gathered_after_forward"] = whole / sum(p.numel() for p in params)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.record["losses"].append(float(loss))
        params = list(pl_module.parameters())
        numel = sum(p.numel() for p in params)
        self.record.update(
            state_bytes=local_state_bytes(pl_module, trainer.optimizers),
            whole_bytes=4 * numel * 4 + 4 * len(params),
            param_devices=sorted({str(_local(p).device) for p in params}),
            grad_dtypes=sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
            dtensor=all(isinstance(p, DTensor) for p in params),
            state_devices=sorted(
                {
                    str(_local(v).device)
                    for o in trainer.optimizers
                    for s in o.state.values()
                    for k, v in s.items()
                    if k != "step"  # AdamW keeps its step count on the CPU on every device
                }
            ),
        )

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.record.setdefault("val_losses", []).append(float(trainer.callback_metrics["val_loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record["world_size"] = trainer.world_size
        self.record["tied"] = pl_module.get_parameter(self.tie[0]) is pl_module.get_parameter(self.tie[1])
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


def fit(
    out: Path, world: int, name: str, model: str, arm: str, callbacks: tuple[Callback, ...] = (), **trainer: Any
) -> None:
    pl.seed_everything(0, verbose=False)
    module = MODELS[model]()
    run = pl.Trainer(
        accelerator="cpu", devices=world, strategy=MirroredStrategy(**ARMS[arm]), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=out / name,
        callbacks=[SaveParams(str(out / name)), Probe(out / name, BLOCKS[model], TIES[model]), *callbacks], **trainer,
    )  # fmt: skip
    accumulate = int(trainer.get("accumulate_grad_batches", 1))
    validate = trainer.get("limit_val_batches", 0) > 0
    start = time.perf_counter()
    run.fit(module, data(world, STEPS * accumulate), data(world, 1) if validate else None)
    print(f"zero3_runs: {name} at {world} ranks fit in {time.perf_counter() - start:.1f} s", flush=True)


def parity_suite(out: Path, world: int) -> None:
    """Every arm at 2 ranks; plain and zero3 only at 4 (4 processes on this machine's 2 cores are slow)."""
    arms = ("plain", "zero3", "offload", "fsdp2") if world == 2 else ("plain", "zero3")
    for model in ("tied", "hf"):
        for arm in arms:
            if arm != "fsdp2" or model == "tied":
                fit(out, world, f"{model}-{arm}", model, arm, max_steps=STEPS)


def compose_suite(out: Path, world: int) -> None:
    for arm in ("plain", "zero3"):
        syncs = (RecordGradientSync(str(out / "accum-syncs")),) if arm == "zero3" else ()  # FSDP2 only
        fit(out, world, f"accum-{arm}", "tied", arm, syncs, max_steps=STEPS, accumulate_grad_batches=2,
            limit_val_batches=1, val_check_interval=4)  # fmt: skip
        fit(out, world, f"manual-{arm}", "manual", arm, max_steps=STEPS)
        fit(out, world, f"bf16-{arm}", "tied", arm, max_steps=STEPS, precision="bf16-mixed")


def main(out: str, suite: str) -> None:
    torch.set_num_threads(1)
    Path(out).mkdir(parents=True, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it after a fit
    {"parity": parity_suite, "compose": compose_suite}[suite](Path(out), world)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
