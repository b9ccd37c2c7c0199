"""``ds-train`` with a model and a datamodule that both save hyperparameters, on every supported Lightning.

Lightning < 2.5 compares LightningCLI's internal ``_class_path`` hparam of the two and stops with "Error while merging
hparams" before the first step (Lightning issue 20182); ``DSLightningCLI`` keeps that key in the model's hparams only.
"""

from __future__ import annotations

from pathlib import Path

import lightning
import torch
import yaml

from ds_lightning.cli import DSLightningCLI
from ds_lightning.demos import DigitsClassifier, DigitsDataModule


def _fit(tmp_path: Path) -> DSLightningCLI:
    return DSLightningCLI(
        model_class=None,
        datamodule_class=None,
        args=[
            "fit",
            "--model=ds_lightning.demos.DigitsClassifier",
            "--model.lr=0.07",
            "--data=ds_lightning.demos.DigitsDataModule",
            "--data.batch_size=16",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        save_config_kwargs={"overwrite": True},
    )


def test_model_and_datamodule_hparams_merge_and_are_logged(tmp_path):
    cli = _fit(tmp_path)

    assert cli.trainer.global_step == 2, f"fit stopped early on Lightning {lightning.__version__}"
    logged = yaml.safe_load(next(tmp_path.rglob("hparams.yaml")).read_text())
    assert logged["lr"] == 0.07
    assert logged["batch_size"] == 16
    assert cli.model.hparams_initial["_class_path"] == "ds_lightning.demos.DigitsClassifier"
    assert cli.datamodule.hparams.batch_size == 16


def test_model_and_datamodule_reload_from_the_checkpoint(tmp_path):
    cli = _fit(tmp_path)
    ckpt = next(tmp_path.rglob("*.ckpt"))

    model = DigitsClassifier.load_from_checkpoint(ckpt)
    data = DigitsDataModule.load_from_checkpoint(ckpt)

    assert model.hparams.lr == 0.07
    assert data.batch_size == 16
    for name, value in cli.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)
