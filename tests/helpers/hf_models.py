"""A model defined outside this project: transformers' ``GPT2LMHeadModel`` built from a ``GPT2Config``, no weights.

``HFGPT2`` is the LightningModule a user would write around it: ``self.net`` is the transformers model, a batch is
``(input_ids, labels)`` of byte ids like the GPT demo's, and the loss is the mean next-token cross-entropy.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def gpt2_config(n_layer: int = 4, n_head: int = 2, d_model: int = 32, block_size: int = 16) -> GPT2Config:
    """A small GPT-2 over bytes, deterministic (no dropout) and without a KV cache (training only)."""
    return GPT2Config(
        vocab_size=256,
        n_positions=block_size,
        n_embd=d_model,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a transformers output, a tuple or a bare tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    return output[0]


class HFGPT2(pl.LightningModule):
    """transformers' GPT-2 (tied embedding and head) as a byte-level language model."""

    def __init__(
        self, n_layer: int = 4, n_head: int = 2, d_model: int = 32, block_size: int = 16, lr: float = 1e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = GPT2LMHeadModel(gpt2_config(n_layer, n_head, d_model, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(self.net(x))

    def pipeline_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
