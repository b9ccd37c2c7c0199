"""Every GPT example config trains through ``ds-train`` for a few steps, validates, and writes a text sample.

The model is shrunk by command-line overrides (the configs' own sizes are measured in docs/gpt.md), so each run
takes seconds; what is checked is that the config's strategy and callbacks train the GPT on the real text.
"""

from __future__ import annotations

import math
import re

import pytest

from tests.helpers.runner import CONFIGS, ds_train, quiet_trainer_args

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


@pytest.mark.parametrize("config", ["gpt_mirrored", "gpt_pipeline", "gpt_parameter_server", "gpt_callbacks"])
def test_gpt_config_trains_validates_and_samples(tmp_path, config):
    report = tmp_path / "report.json"
    run = ds_train(
        [
            "fit",
            f"--config={CONFIGS / f'{config}.yaml'}",
            *quiet_trainer_args(tmp_path),
            *SMALL,
            # The list's last callback is TrainingReport; time from the second step on.
            f"--trainer.callbacks.output_json={report}",
            "--trainer.callbacks.warmup_steps=1",
        ],
        timeout=300,
    )
    figures = run.json(report)
    assert figures["world_size"] == 2
    # Byte-level perplexity: finite, and below the 256 of a uniform guess only if something was learned; after 4
    # steps it is merely finite and positive.
    assert math.isfinite(figures["val_ppl"]) and figures["val_ppl"] > 1
    assert figures["tokens_per_s"] > 0
    # Tokens trained in the timed steps (all but the first), each counted once: a pipeline's stages share a batch.
    windows_per_step = {"gpt_mirrored": 2 * 8, "gpt_pipeline": 8}.get(config)
    if windows_per_step is not None:
        assert figures["tokens_timed"] == figures["steps_timed"] * windows_per_step * 32
    # TextSample printed 200 sampled bytes after the prompt (4 batches are 2 optimizer steps under accumulation).
    assert re.search(r"\[ds_lightning\] sample after [24] steps:\ndef ", run.output), run.output[-3000:]
