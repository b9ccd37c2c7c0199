"""The GPT workload in the shape users bring: embeddings, a ``ModuleList`` of blocks and a head tied to the embedding.

:class:`TiedGPT` is :class:`~ds_lightning.demos.gpt.GPT` with its network built as one ``nn.Module`` instead of an
``nn.Sequential`` (nanoGPT's layout). The tests and benchmarks of the large-model features use it to show they take a
model that was not written for them.
"""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from ds_lightning.demos.gpt import _VOCAB, GPT, _Block

__all__ = ["TiedGPT", "TiedTransformer"]


class TiedTransformer(nn.Module):
    """Token and position embeddings, ``blocks`` (a ``ModuleList``), a final LayerNorm and a head tied to ``token``.

    ``forward(tokens)`` maps int64 byte ids ``(B, T)`` to logits ``(B, T, 256)``. The head has no bias and its weight
    *is* the token embedding's (one ``nn.Parameter`` under two names), as in GPT-2 and nanoGPT.
    """

    def __init__(self, blocks: list[_Block], d_model: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.token = nn.Embedding(_VOCAB, d_model)
        self.position = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, _VOCAB, bias=False)
        self.head.weight = self.token.weight

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        x = self.drop(self.token(tokens) + self.position(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TiedGPT(GPT):
    """:class:`~ds_lightning.demos.gpt.GPT` whose ``net`` is a :class:`TiedTransformer` (not an ``nn.Sequential``).

    Same arguments, batches, logging and optimizer as ``GPT``; the tied head saves ``256 x d_model`` parameters.
    Under ``ds_pipeline`` the network is split by torch's tracer (``split_points``), not by layer counts.
    """

    @override
    def _build_net(self, blocks: list[_Block], d_model: int, block_size: int, dropout: float) -> nn.Module:
        return TiedTransformer(blocks, d_model, block_size, dropout)
