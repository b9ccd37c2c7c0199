"""One short fit under one ds strategy, chosen by registry name: ``python .ci/strategy_smoke.py ds_pipeline``.

Part of ``.ci/versions``: it checks that each strategy still trains on a given Lightning/torch pair. Exits non-zero
(with the traceback) when the fit fails or takes no optimizer step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl

from ds_lightning.demos import DigitsClassifier, DigitsDataModule
from tests.helpers.trainers import quiet_trainer

# Processes per strategy: ds_model_parallel splits the model inside one process.
DEVICES = {"ds_mirrored": 2, "ds_pipeline": 2, "ds_model_parallel": 1, "ds_parameter_server": 2}
STEPS = 3


def main(name: str) -> None:
    """Fit the digits classifier for ``STEPS`` steps under strategy ``name`` and check that it stepped."""
    if name not in DEVICES:
        raise SystemExit(f"unknown strategy {name!r}; choose one of {sorted(DEVICES)}")
    pl.seed_everything(0, workers=True)
    trainer = quiet_trainer(
        Path.cwd(),
        [],
        strategy=name,
        devices=DEVICES[name],
        max_epochs=1,
        limit_train_batches=STEPS,
        limit_val_batches=1,
    )
    trainer.fit(DigitsClassifier(hidden_sizes=[32, 32]), DigitsDataModule(batch_size=32))
    if trainer.is_global_zero:
        if trainer.global_step < 1:
            raise SystemExit(f"{name}: fit took no optimizer step (global_step={trainer.global_step})")
        print(f"SMOKE OK {name} global_step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
