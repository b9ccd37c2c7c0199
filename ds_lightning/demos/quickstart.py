"""What ``ds-train train --strategy=NAME`` trains when no model, data or config is given: the bundled digits demo.

The seed documents its command as ``train --strategy=mirrored``; :data:`SHORT_NAMES` maps each short name to the name
the strategy is registered under in Lightning's registry.
"""

from __future__ import annotations

import json

import torch

__all__ = ["SHORT_NAMES", "demo_config"]

SHORT_NAMES = {
    "mirrored": "ds_mirrored",
    "parameter_server": "ds_parameter_server",
    "pipeline": "ds_pipeline",
    "model_parallel": "ds_model_parallel",
}


def demo_config(strategy: str) -> str:
    """The demo's LightningCLI configuration, as the JSON text ``--config`` takes.

    ``strategy`` is a registered name or a class path.

    The digits classifier with two hidden layers (so that two pipeline stages or two devices each get layers), 5
    epochs, and the training report. ``ds_model_parallel`` places its stages on the devices of one process; every other
    strategy starts a process per device, and where there is no GPU the demo starts two CPU processes, so that the
    strategy has something to distribute (as ``make demo`` does with the example configs).
    """
    one_process = strategy.startswith("ds_model_parallel")
    # Without CUDA: 2 CPU processes, named so (`auto` would put both on one Apple GPU where MPS is present).
    auto = one_process or torch.cuda.is_available()
    devices: int | str = "auto" if auto else 2
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "auto" if auto else "cpu",
            "devices": devices,
            "strategy": strategy,
            "max_epochs": 5,
            "default_root_dir": f"runs/{strategy.rpartition('.')[2]}",
            "enable_model_summary": False,
            "callbacks": [{"class_path": "ds_lightning.demos.TrainingReport"}],
        },
        "model": {
            "class_path": "ds_lightning.demos.DigitsClassifier",
            "init_args": {"hidden_sizes": [128, 128], "lr": 0.05},
        },
        "data": {"class_path": "ds_lightning.demos.DigitsDataModule", "init_args": {"batch_size": 32}},
    }
    return json.dumps(config)
