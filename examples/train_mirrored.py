"""Train the digits classifier with ds_mirrored from plain Python: ``python examples/train_mirrored.py``.

The script is re-run once per extra process by Lightning's launcher, so keep the work under ``__main__``.
"""

import lightning.pytorch as pl

import ds_lightning  # noqa: F401  (registers "ds_mirrored")
from ds_lightning.demos import DigitsClassifier, DigitsDataModule, TrainingReport

if __name__ == "__main__":
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ds_mirrored",
        max_epochs=3,
        default_root_dir="runs/example",
        callbacks=[TrainingReport()],
    )
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule(batch_size=32))
