"""A small decoder-only byte-level transformer, the GPT workload of the examples, tests and benchmarks."""

from __future__ import annotations

import math
from typing import cast

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.text import Perplexity
from typing_extensions import override

from ds_lightning._validation import integer, number

__all__ = ["GPT"]

_VOCAB = 256  # one token per byte: any text is covered and no tokenizer is needed


class _Embedding(nn.Module):
    """Token ids ``(B, T)`` to their embedding plus a learned position embedding, ``(B, T, d_model)``."""

    def __init__(self, block_size: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.token = nn.Embedding(_VOCAB, d_model)
        self.position = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        if length > self.position.num_embeddings:
            raise ValueError(
                f"A sequence of {length} tokens is longer than block_size={self.position.num_embeddings}; "
                f"crop it to the last {self.position.num_embeddings} tokens or build GPT(block_size={length})."
            )
        positions = torch.arange(length, device=tokens.device)
        return self.drop(self.token(tokens) + self.position(positions))


class _CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # (B, T, 3C) -> three (B, heads, T, head_dim) tensors
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(batch, length, width)))


class _Block(nn.Module):
    """Pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, n_head, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(pl.LightningModule):
    """Decoder-only transformer language model over bytes (a vocabulary of 256), logging loss and perplexity.

    The network is the ``nn.Sequential`` attribute ``net``: an embedding (tokens plus learned positions), ``n_layer``
    pre-norm blocks (causal self-attention, GELU MLP of 4x width), a final LayerNorm and a linear head to 256 logits.
    Each element maps one tensor to one tensor and no parameters are shared (no weight tying), so ``net`` meets the
    ``ds_pipeline`` contract with ``pipeline_loss`` and the same model runs under every strategy.

    A batch is ``(x, y)``: int64 byte ids ``(B, T)`` with ``T <= block_size``, and ``y`` the same bytes shifted by one.

    Parameter counts (``block_size=128`` unless given; measured):

    | arguments                                              | parameters |
    |--------------------------------------------------------|-----------:|
    | defaults (``n_layer=4, n_head=4, d_model=128``)        |     0.88 M |
    | ``n_layer=6, n_head=6, d_model=384``                   |    10.89 M |
    | ``n_layer=12, n_head=12, d_model=768``                 |    85.55 M |
    | ``n_layer=14, n_head=12, d_model=768, block_size=256`` |    99.82 M |

    Args:
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``d_model``.
        d_model: width of the residual stream.
        block_size: longest sequence (context) the model takes.
        dropout: dropout probability on embeddings, attention and residual branches (0 for exact parity runs).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay on matrices and embeddings (never on biases or norms).

    Raises:
        ValueError: for a non-positive size, ``d_model`` not a multiple of ``n_head``, ``dropout`` outside
            ``[0, 1)``, ``lr <= 0`` or ``weight_decay < 0``, naming the value and the fix.

    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        integer("n_layer", n_layer, 1, "GPT(n_layer=4)")
        integer("n_head", n_head, 1, "GPT(n_head=4)")
        integer("d_model", d_model, 1, "GPT(d_model=128)")
        integer("block_size", block_size, 1, "GPT(block_size=128)")
        if d_model % n_head:
            fit = n_head * max(1, round(d_model / n_head))
            raise ValueError(
                f"d_model={d_model} must be a multiple of n_head={n_head}; e.g. GPT(d_model={fit}, n_head={n_head})."
            )
        number("dropout", dropout, "GPT(dropout=0.1)", at_least=0.0, below=1.0)
        number("lr", lr, "GPT(lr=3e-4)", above=0.0)
        number("weight_decay", weight_decay, "GPT(weight_decay=0.1)", at_least=0.0)
        self.save_hyperparameters()
        blocks = [_Block(d_model, n_head, dropout) for _ in range(n_layer)]
        self.net = self._build_net(blocks, d_model, block_size, dropout)
        self._init_weights(blocks, n_layer)
        self.val_ppl = Perplexity()
        self.test_ppl = Perplexity()

    def _build_net(self, blocks: list[_Block], d_model: int, block_size: int, dropout: float) -> nn.Module:
        # One tensor in, one out per element, nothing shared: the nn.Sequential contract of ds_pipeline.
        return nn.Sequential(
            _Embedding(block_size, d_model, dropout), *blocks, nn.LayerNorm(d_model), nn.Linear(d_model, _VOCAB)
        )

    def _init_weights(self, blocks: list[_Block], n_layer: int) -> None:
        for module in self.net.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # Each block adds two branches to the residual stream; scaling them keeps its variance flat with depth.
        for block in blocks:
            for out in (block.attn.proj.weight, cast(nn.Linear, block.mlp[2]).weight):
                nn.init.normal_(out, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-byte logits ``(B, T, 256)`` for byte ids ``(B, T)``."""
        return self.net(x)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token of logits ``(B, T, 256)`` against byte ids ``(B, T)``."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """One optimisation step's loss; logs ``train_loss``."""
        x, y = batch
        loss = self.pipeline_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Logs ``val_loss`` and ``val_ppl``, reduced over all ranks."""
        x, y = batch
        logits = self.net(x)
        self.val_ppl(logits.float(), y)  # under bf16 autocast: torchmetrics 1.0 takes fp32/fp64 only
        self.log("val_loss", self.pipeline_loss(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Logs ``test_loss`` and ``test_ppl``, reduced over all ranks."""
        x, y = batch
        logits = self.net(x)
        self.test_ppl(logits.float(), y)
        self.log("test_loss", self.pipeline_loss(logits, y), sync_dist=True)
        self.log("test_ppl", self.test_ppl)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW with betas ``(0.9, 0.95)`` and two param groups, always both and in this order.

        Group 0 holds the matrices and embeddings (``dim >= 2``, decayed), group 1 the biases and LayerNorm weights (not
        decayed). Under ``ds_pipeline`` each stage sees only its own parameters and every stage must build the same
        groups, so a group may be empty.
        """
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams["lr"], betas=(0.9, 0.95))

    @torch.no_grad()
    def generate_tokens(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` bytes after ``tokens``, one at a time, in eval mode.

        Run it on one process (or after ``fit()``): under ``ds_pipeline`` during training ``net`` is a collective.

        Args:
            tokens: int64 byte ids, ``(T,)`` or ``(B, T)`` with ``T >= 1``; only the last ``block_size`` are seen.
            max_new_tokens: how many bytes to add.
            temperature: divides the logits; lower is more conservative.
            top_k: sample only among the ``top_k`` likeliest bytes; ``None`` for all 256.
            seed: seeds a private generator, so the sample is reproducible and the global RNG is untouched.

        Returns:
            ``tokens`` followed by the new bytes, ``(T + max_new_tokens,)`` or ``(B, T + max_new_tokens)``.

        Raises:
            ValueError: for an empty ``tokens`` or a bad sampling option, naming the value.

        """
        integer("max_new_tokens", max_new_tokens, 0, "generate_tokens(tokens, max_new_tokens=100)")
        number("temperature", temperature, "temperature=0.8", above=0.0)
        if top_k is not None:
            integer("top_k", top_k, 1, "top_k=40, or None for all 256 bytes")
        if tokens.dim() not in (1, 2) or tokens.shape[-1] < 1:
            raise ValueError(f"tokens of shape {list(tokens.shape)} must be (T,) or (B, T) with T >= 1.")
        out = tokens.to(self.device, torch.long).reshape(-1, tokens.shape[-1])
        generator = None
        if seed is not None:
            generator = torch.Generator(device=out.device).manual_seed(seed)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self.net(out[:, -self.hparams["block_size"] :])[:, -1, :] / temperature
                if top_k is not None and top_k < _VOCAB:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                out = torch.cat([out, torch.multinomial(probs, 1, generator=generator)], dim=1)
        finally:
            self.train(was_training)
        return out if tokens.dim() == 2 else out[0]

    def generate(
        self,
        prompt: str,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> str:
        """``prompt`` followed by ``max_new_tokens`` sampled bytes, decoded as UTF-8 (bad bytes become U+FFFD).

        The prompt (non-empty) is encoded as UTF-8 bytes; the other arguments are those of `generate_tokens`.

        Raises:
            ValueError: for an empty prompt or a bad sampling option.

        """
        data = prompt.encode("utf-8")
        if not data:
            raise ValueError("prompt='' is empty; give at least one character to continue, e.g. generate('\\n', 200).")
        tokens = torch.tensor(list(data), dtype=torch.long)
        out = self.generate_tokens(tokens, max_new_tokens, temperature, top_k, seed)
        return prompt + bytes(out[len(data) :].tolist()).decode("utf-8", errors="replace")
