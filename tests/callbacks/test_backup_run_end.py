"""BackupAndRestore leaves nothing in flight when a run ends: the last step's agreement is read at the end of training
(an async gloo work still held at interpreter exit can abort the process) and forgotten at teardown."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from ds_lightning.callbacks import BackupAndRestore
from tests.helpers.backup_runs import Net, make_data


class SeesAgreement(pl.Callback):
    """Records whether an agreement was in flight as each batch ended (after BackupAndRestore's own hook)."""

    def __init__(self, backup: BackupAndRestore) -> None:
        self.backup, self.in_flight = backup, []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.in_flight.append(self.backup._agreement._pending is not None)


def test_the_last_steps_agreement_is_read_when_training_ends(tmp_path: Path) -> None:
    backup = BackupAndRestore(str(tmp_path / "backups"), every_n_train_steps=2)
    seen = SeesAgreement(backup)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[backup, seen], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Net(), DataLoader(make_data(32), batch_size=8))
    assert len(seen.in_flight) == 4 and seen.in_flight[-1]  # the last step started one, as every step does
    assert backup._agreement._pending is None  # the last one: read at the end of training
