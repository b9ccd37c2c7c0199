"""The standard library's own ``.py`` sources as byte-level language-modelling data: real text, no download."""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence, Sized
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler
from typing_extensions import override

__all__ = ["ByteWindows", "TextDataModule", "decode", "encode"]

# Test suites (some hold deliberately malformed files), installed packages and bytecode are not the library's text.
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "testmock", "testdata", "site-packages", "dist-packages", "__pycache__"}
)


def encode(text: str) -> torch.Tensor:
    """``text``'s UTF-8 bytes as an int64 tensor of token ids in 0..255."""
    return torch.from_numpy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64))


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """Token ids (bytes, 0..255) back to text; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(torch.as_tensor(tokens).flatten().tolist()).decode("utf-8", errors="replace")


def _stream_seed(seed: int, *stream: object) -> int:
    """A seed for one named random stream of ``seed``, so train, validation and order never share draws."""
    digest = hashlib.blake2b(repr((seed, *stream)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _skipped(directory: str) -> bool:
    return directory in _SKIPPED_DIRS or directory.startswith("test_")


@functools.lru_cache(maxsize=2)
def _read_sources(root: str) -> tuple[tuple[str, bytes], ...]:
    """Every ``.py`` file under ``root`` outside test suites, as (relative POSIX path, bytes), sorted by path."""
    found: list[tuple[str, bytes]] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if not _skipped(d)]
        for name in files:
            if name.endswith(".py"):
                path = Path(directory, name)
                found.append((path.relative_to(root).as_posix(), path.read_bytes()))
    if not found:
        raise FileNotFoundError(
            f"No standard-library .py sources under {root!r} (sysconfig.get_paths()['stdlib']): this Python ships"
            " without them (a slim, embedded or zipped build). Run with a full CPython install (python.org, pyenv,"
            " or the distribution's python3 stdlib package)."
        )
    return tuple(sorted(found))


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of ``block_size + 1`` bytes of ``text`` at fixed ``starts``; item i is ``(window[:-1], window[1:])``.

    Args:
        text: the split's bytes, uint8.
        starts: one start offset per sample.
        block_size: tokens per input (and per target).

    """

    def __init__(self, text: torch.Tensor, starts: torch.Tensor, block_size: int) -> None:
        self.text = text
        self.starts = starts
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.starts)

    @override
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[index])
        window = self.text[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


class _EpochShuffle(RandomSampler):
    """A permutation that is a function of ``(seed, epoch)``: Lightning calls ``set_epoch`` before each epoch.

    A ``RandomSampler`` so that multi-process strategies see a shuffled loader and put their ``DistributedSampler``
    in its place (seeded by ``seed_everything``).
    """

    def __init__(self, data_source: Sized, seed: int) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @override
    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(_stream_seed(self.seed, "order", self.epoch))
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


def _held_out(sizes: list[int], fraction: float, seed: int) -> set[int]:
    """Indices of the files for validation: in an order permuted by ``seed``, until they hold ``fraction`` of all."""
    target, held = fraction * sum(sizes), 0
    chosen: set[int] = set()
    for i in torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist():
        if held >= target:
            break
        chosen.add(i)
        held += sizes[i]
    return chosen


def _check_int(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}={value!r} must be an integer >= {least}.")


class TextDataModule(pl.LightningDataModule):
    """Byte-level language modelling on the Python standard library's sources, the same on every rank for a seed.

    ``setup`` reads every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (test suites, ``site-packages`` and
    ``__pycache__`` excluded; about 12 MB on CPython 3.11; read once per process). The split is by file: the files,
    in sorted path order, are permuted by ``seed`` and go to validation until they hold ``val_fraction`` of the
    bytes. Each split is its files joined by newlines. An epoch has ``len(split) // block_size`` windows of
    ``block_size + 1`` bytes, at starts drawn once from ``seed`` (validation from another stream, so any prefix of it
    is a fair sample). Training windows come in an order that is a function of ``seed`` and the epoch; validation in
    a fixed order.

    After ``setup``: ``train_set``, ``val_set`` (`ByteWindows`), ``train_files``, ``val_files`` (paths
    relative to ``source_dir``) and ``train_bytes``, ``val_bytes`` (the lengths of the joined splits).

    Args:
        block_size: tokens per sample (the model's context length).
        batch_size: per-device batch size.
        val_fraction: share of the bytes held out for validation (and test), by whole files.
        seed: seed of the split, the windows and the training order.
        num_workers: DataLoader worker processes; 0 keeps loading in the training process.

    Raises:
        ValueError: for a size < 1, a fraction outside (0, 1), a negative seed or worker count.

    """

    vocab_size = 256

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        _check_int("block_size", block_size, 1)
        _check_int("batch_size", batch_size, 1)
        _check_int("seed", seed, 0)
        _check_int("num_workers", num_workers, 0)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction!r} must lie strictly between 0 and 1, e.g. 0.05.")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = float(val_fraction)
        self.seed = seed
        self.num_workers = num_workers
        self.source_dir = ""
        self.train_files: list[str] = []
        self.val_files: list[str] = []
        self.train_bytes = 0
        self.val_bytes = 0
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    @override
    def setup(self, stage: str) -> None:
        """Read and split the sources (every rank does it locally: the same seed gives the same split).

        Raises:
            FileNotFoundError: when the standard library has no ``.py`` sources.
            ValueError: when a split is no longer than ``block_size``.

        """
        if self.train_set is not None:
            return
        self.source_dir = sysconfig.get_paths()["stdlib"]
        sources = _read_sources(self.source_dir)
        held_out = _held_out([len(data) for _, data in sources], self.val_fraction, self.seed)
        train_part = [source for i, source in enumerate(sources) if i not in held_out]
        val_part = [source for i, source in enumerate(sources) if i in held_out]
        self.train_files, self.val_files = [path for path, _ in train_part], [path for path, _ in val_part]
        train, val = self._join(train_part, "train"), self._join(val_part, "validation")
        self.train_bytes, self.val_bytes = len(train), len(val)
        self.train_set = ByteWindows(train, self._starts(train, "train"), self.block_size)
        self.val_set = ByteWindows(val, self._starts(val, "val"), self.block_size)

    def _join(self, part: list[tuple[str, bytes]], split: str) -> torch.Tensor:
        text = b"\n".join(data for _, data in part)
        if len(text) <= self.block_size:
            raise ValueError(
                f"The {split} split holds {len(text)} bytes, no more than block_size={self.block_size}: choose a"
                f" block_size below {len(text)}, or a val_fraction (now {self.val_fraction}) that gives it more."
            )
        return torch.from_numpy(np.frombuffer(text, dtype=np.uint8).copy())

    def _starts(self, text: torch.Tensor, stream: str) -> torch.Tensor:
        generator = torch.Generator().manual_seed(_stream_seed(self.seed, stream))
        return torch.randint(0, len(text) - self.block_size, (len(text) // self.block_size,), generator=generator)

    @override
    def train_dataloader(self) -> DataLoader:
        """Training windows in an order set by ``seed`` and the epoch; a last partial batch is dropped.

        Under a multi-process strategy Lightning puts its ``DistributedSampler`` (seeded by ``seed_everything``) in
        place of this order.
        """
        assert self.train_set is not None, "call setup() first"
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=_EpochShuffle(self.train_set, self.seed),
            drop_last=True,
            num_workers=self.num_workers,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        """Validation windows in a fixed order (already at random starts)."""
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)

    @override
    def test_dataloader(self) -> DataLoader:
        """The validation split (the sources have no separate test set)."""
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> DataLoader:
        """The validation split."""
        return self.val_dataloader()
