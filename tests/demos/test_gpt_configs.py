"""Every GPT example config trains through ``ds-train`` for a few steps, validates, and writes a text sample.

The model is shrunk by command-line overrides (the configs' own sizes are measured in docs/gpt.md), so each run
takes seconds; what is checked is that the config's strategy and callbacks train the GPT on the real text.
"""

from __future__ import annotations

import math
import re

import lightning.pytorch as pl
import pytest
import torch

from ds_lightning.demos import GPT, TextDataModule
from tests.helpers.runner import ds_train, example_config, quiet_trainer_args

pytestmark = pytest.mark.multiprocess

SMALL = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.d_model=32",
    "--model.block_size=32",
    "--data.block_size=32",
    "--data.batch_size=8",
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=4",
    "--trainer.limit_val_batches=2",
]
# gpt_callbacks warms its rate up over 50 steps from a tenth: 4 micro-batches are 2 steps at about a tenth of it, so
# the base rate is 10x for those steps to learn as much as the other configs' 4.
EXTRA = {"gpt_callbacks": ["--model.lr=0.03"]}
# Byte-level perplexity of a uniform guess, 256, and of the untrained model (256.7 on these batches: see below). After
# 4 batches the configs measured 119 to 165; a run that learned nothing (256.7) misses this bound by 25%.
LEARNED_PPL = 0.8 * 256


@pytest.mark.parametrize("config", ["gpt_mirrored", "gpt_pipeline", "gpt_parameter_server", "gpt_callbacks"])
def test_gpt_config_trains_validates_and_samples(tmp_path, config):
    report = tmp_path / "report.json"
    run = ds_train(
        [
            "fit",
            *example_config(f"{config}.yaml"),
            *quiet_trainer_args(tmp_path),
            *SMALL,
            # The list's last callback is TrainingReport; time from the second step on.
            f"--trainer.callbacks.output_json={report}",
            "--trainer.callbacks.warmup_steps=1",
            *EXTRA.get(config, []),
        ],
        timeout=280,  # under pytest's 300 s, so a hang fails here with the run's output
    )
    figures = run.json(report)
    assert figures["world_size"] == 2
    assert figures["val_ppl"] < LEARNED_PPL, figures  # it learned: NaN fails too
    assert figures["tokens_per_s"] > 0
    # Tokens trained in the timed steps (all but the first), each counted once: a pipeline's stages share a batch.
    windows_per_step = {"gpt_mirrored": 2 * 8, "gpt_pipeline": 8}.get(config)
    if windows_per_step is not None:
        assert figures["tokens_timed"] == figures["steps_timed"] * windows_per_step * 32
    # TextSample printed 200 sampled bytes after the prompt (4 batches are 2 optimizer steps under accumulation).
    assert re.search(r"\[ds_lightning\] sample after [24] steps:\ndef ", run.output), run.output[-3000:]


def test_an_untrained_gpt_misses_the_learned_bound():
    """The control: the configs' model before any step, on the first 2 validation batches, is a uniform guess."""
    pl.seed_everything(0)  # as the configs' seed_everything
    model = GPT(n_layer=2, n_head=2, d_model=32, block_size=32).eval()
    data = TextDataModule(block_size=32, batch_size=8)
    data.setup("fit")
    losses = []
    with torch.no_grad():
        for _, (x, y) in zip(range(2), data.val_dataloader(), strict=False):
            losses.append(model.pipeline_loss(model(x), y).item())
    untrained = math.exp(sum(losses) / len(losses))
    assert untrained == pytest.approx(256, rel=0.01)
    assert untrained > 1.2 * LEARNED_PPL
