"""The bundled digits data and classifier, on one process."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from ds_lightning.demos import DigitsClassifier, DigitsDataModule, TrainingReport, make_mlp


def test_split_is_deterministic_and_complete():
    a, b = DigitsDataModule(seed=3), DigitsDataModule(seed=3)
    a.setup("fit")
    b.setup("fit")
    assert len(a.train_set) + len(a.val_set) == 1797
    assert len(a.val_set) == round(1797 * 0.2)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    x, y = a.train_set.tensors
    assert x.shape[1] == 64 and x.min() >= 0.0 and x.max() <= 1.0
    assert set(y.tolist()) == set(range(10))
    other = DigitsDataModule(seed=4)
    other.setup("fit")
    assert not torch.equal(other.val_set.tensors[1], a.val_set.tensors[1])


@pytest.mark.parametrize(("kwargs", "message"), [({"batch_size": 0}, "batch_size=0"), ({"val_fraction": 1.5}, "1.5")])
def test_bad_datamodule_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DigitsDataModule(**kwargs)


def test_mlp_shape():
    net = make_mlp(64, [1024, 1024], 10)
    assert sum(p.numel() for p in net.parameters()) == 64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10


def test_classifier_learns_the_digits_on_one_device(tmp_path, capsys):
    pl.seed_everything(0)
    report_path = tmp_path / "report.json"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=4,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[TrainingReport(output_json=str(report_path))],
    )
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule())
    assert trainer.callback_metrics["val_acc"] > 0.9
    out = capsys.readouterr().out
    assert "[ds_lightning]" in out and "samples/s" in out
    import json

    report = json.loads(report_path.read_text())
    assert report["val_acc"] > 0.9 and report["samples_per_s"] > 0 and report["steps_timed"] > 0
