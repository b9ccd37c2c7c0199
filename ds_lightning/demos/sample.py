"""A callback that shows what a language model learned: text it writes from a prompt, printed on rank 0."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from ds_lightning import _validation as check

__all__ = ["TextSample"]


class TextSample(Callback):
    """At the end of ``fit``, rank 0 samples text from the model's ``generate`` (e.g. :class:`GPT`) and prints it.

    It runs after the strategy's teardown, when every strategy has put the whole model back in the process (a
    pipeline's stages merged), so sampling needs no other process.

    Args:
        prompt: the text to continue.
        max_new_tokens: bytes to sample after it.
        temperature: softmax temperature (lower is more conservative).
        top_k: sample among the ``top_k`` likeliest bytes only; ``None`` for all.
        seed: the sampling's own random seed, so a run's sample can be reproduced.
        output_path: also write the sample to this file.

    Raises:
        ValueError: for an empty prompt or a non-positive count, temperature or ``top_k``.

    """

    def __init__(
        self,
        prompt: str = "def ",
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = 40,
        seed: int = 0,
        output_path: str | None = None,
    ) -> None:
        if not prompt:
            raise ValueError("prompt='' is empty: give the text to continue, e.g. prompt='def '.")
        check.integer("max_new_tokens", max_new_tokens, 1, "TextSample(max_new_tokens=200)")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0, e.g. temperature=0.8.")
        if top_k is not None:
            check.integer("top_k", top_k, 1, "TextSample(top_k=40)")
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self.output_path = output_path
        self.text: str | None = None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        generate = getattr(pl_module, "generate", None)
        if generate is None:
            rank_zero_warn(f"TextSample: {type(pl_module).__name__} has no generate(); no sample (use a GPT).")
            return
        self.text = generate(
            self.prompt, self.max_new_tokens, temperature=self.temperature, top_k=self.top_k, seed=self.seed
        )
        print(f"[ds_lightning] sample after {trainer.global_step} steps:\n{self.text}", flush=True)
        if self.output_path:
            Path(self.output_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.output_path).write_text(self.text)
