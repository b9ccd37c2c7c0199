"""The standard library's text as byte-level language-modelling data, on one process."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_lightning.demos import TextDataModule, decode, encode


def _ready(**kwargs: object) -> TextDataModule:
    data = TextDataModule(**kwargs)
    data.setup("fit")
    return data


@pytest.fixture(scope="module")
def seed0() -> TextDataModule:
    return _ready(seed=0)


@pytest.fixture(scope="module")
def seed0_again() -> TextDataModule:
    return _ready(seed=0)


@pytest.fixture(scope="module")
def seed1() -> TextDataModule:
    return _ready(seed=1)


def _order(data: TextDataModule, epoch: int) -> list[int]:
    sampler = data.train_dataloader().sampler
    sampler.set_epoch(epoch)
    return list(sampler)


def test_same_seed_gives_the_same_split_windows_and_order(seed0, seed0_again):
    assert seed0.train_files == seed0_again.train_files and seed0.val_files == seed0_again.val_files
    assert torch.equal(seed0.train_set.text, seed0_again.train_set.text)
    assert torch.equal(seed0.train_set.starts, seed0_again.train_set.starts)
    assert torch.equal(seed0.val_set.starts, seed0_again.val_set.starts)
    assert _order(seed0, 0) == _order(seed0_again, 0)
    first, again = next(iter(seed0.train_dataloader())), next(iter(seed0_again.train_dataloader()))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_another_seed_gives_another_split_windows_and_order(seed0, seed1):
    assert seed0.val_files != seed1.val_files
    assert not torch.equal(seed0.train_set.starts[:100], seed1.train_set.starts[:100])
    assert _order(seed0, 0)[:100] != _order(seed1, 0)[:100]


def test_split_is_by_file_and_holds_val_fraction_of_the_bytes(seed0):
    train, val = set(seed0.train_files), set(seed0.val_files)
    assert train and val and not train & val
    size = {f: (Path(seed0.source_dir) / f).stat().st_size for f in train | val}
    total, held = sum(size.values()), sum(size[f] for f in val)
    # Files go to validation until they reach the fraction: the last one added (at most the largest) crossed it.
    assert held >= 0.05 * total > held - max(size[f] for f in val)
    # Each split is its files joined by newlines, nothing else.
    assert seed0.train_bytes == sum(size[f] for f in train) + len(train) - 1 == len(seed0.train_set.text)
    assert seed0.val_bytes == held + len(val) - 1 == len(seed0.val_set.text)
    assert seed0.train_files == sorted(seed0.train_files)


def test_only_library_sources_are_read(seed0):
    files = seed0.train_files + seed0.val_files
    assert {"os.py", "json/decoder.py", "unittest/case.py"} <= set(files)
    for name in files:
        path = PurePosixPath(name)
        assert path.suffix == ".py"
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(path.parts[:-1]), name
        assert not any(part.startswith("test_") for part in path.parts[:-1]), name


def test_samples_are_windows_shifted_by_one(seed0):
    data = seed0
    block = data.block_size
    assert len(data.train_set) == data.train_bytes // block and len(data.val_set) == data.val_bytes // block
    for dataset in (data.train_set, data.val_set):
        assert int(dataset.starts.min()) >= 0 and int(dataset.starts.max()) + block + 1 <= len(dataset.text)
    for i in (0, 7, len(data.train_set) - 1):
        x, y = data.train_set[i]
        start = int(data.train_set.starts[i])
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (block,)
        assert torch.equal(x, data.train_set.text[start : start + block].long())
        assert torch.equal(x[1:], y[:-1]) and int(y[-1]) == int(data.train_set.text[start + block])
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (data.batch_size, block) and x.dtype == torch.int64
    assert TextDataModule.vocab_size == 256 and int(x.max()) < 256


def test_validation_is_in_a_fixed_order(seed0):
    loader = seed0.val_dataloader()
    x, _ = next(iter(loader))
    assert torch.equal(x, torch.stack([seed0.val_set[i][0] for i in range(seed0.batch_size)]))
    assert torch.equal(next(iter(seed0.test_dataloader()))[0], x)
    # Random starts, so a prefix (limit_val_batches) samples the whole split, not its first files.
    prefix, half = seed0.val_set.starts[: len(seed0.val_set) // 10], len(seed0.val_set.text) // 2
    assert bool((prefix < half).any()) and bool((prefix >= half).any())


def test_loader_order_is_a_function_of_seed_and_epoch(seed0, seed0_again):
    assert _order(seed0, 3) == _order(seed0_again, 3)
    assert _order(seed0, 0) != _order(seed0, 1)
    order = _order(seed0, 1)
    assert sorted(order) == list(range(len(seed0.train_set)))
    loader = seed0.train_dataloader()
    loader.sampler.set_epoch(1)
    assert loader.drop_last and len(loader) == len(seed0.train_set) // seed0.batch_size
    x, _ = next(iter(loader))
    assert torch.equal(x, torch.stack([seed0.train_set[i][0] for i in order[: seed0.batch_size]]))


class _Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Embedding(256, 256)
        self.seen: list[tuple[int, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((self.current_epoch, x.clone()))
        return F.cross_entropy(self.head(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_two_epochs(tmp_path: Path, global_seed: int) -> tuple[TextDataModule, list[tuple[int, torch.Tensor]]]:
    torch.manual_seed(global_seed)  # the data order must not depend on the global random state
    data, model = TextDataModule(block_size=16, batch_size=4), _Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    return data, model.seen


def test_trainer_draws_the_order_of_each_epoch(tmp_path):
    data, seen = _fit_two_epochs(tmp_path / "a", 1)
    _, again = _fit_two_epochs(tmp_path / "b", 2)
    assert [epoch for epoch, _ in seen] == [0, 0, 1, 1]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen, again, strict=True))
    for epoch, first in ((0, seen[0][1]), (1, seen[2][1])):
        order = _order(data, epoch)
        assert torch.equal(first, torch.stack([data.train_set[i][0] for i in order[:4]]))
    assert not torch.equal(seen[0][1], seen[2][1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size=0"),
        ({"block_size": True}, "block_size=True"),
        ({"batch_size": -1}, "batch_size=-1"),
        ({"batch_size": 2.5}, "batch_size=2.5"),
        ({"val_fraction": 0.0}, "val_fraction=0.0"),
        ({"val_fraction": 1}, "val_fraction=1 "),
        ({"val_fraction": 1.5}, "val_fraction=1.5"),
        ({"seed": -1}, "seed=-1"),
        ({"num_workers": -2}, "num_workers=-2"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TextDataModule(**kwargs)


def test_a_block_longer_than_a_split_is_refused(seed0):
    with pytest.raises(ValueError, match="block_size=100000000"):
        TextDataModule(block_size=10**8).setup("fit")


def test_construction_reads_nothing_and_missing_sources_are_named(tmp_path, monkeypatch):
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_only.py").write_text("pass\n")
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"stdlib": str(tmp_path)})
    data = TextDataModule()
    assert data.train_set is None and data.val_set is None
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        data.setup("fit")


def test_encode_decode_round_trip():
    text = "def héllo():\n    return '∑ 🐍'\n"
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and tokens.shape == (len(text.encode("utf-8")),)
    assert encode("é").tolist() == [195, 169] and encode("").shape == (0,)
    assert decode(tokens) == text and decode(tokens.tolist()) == text
    assert decode([104, 255, 105]) == "h\ufffdi"
