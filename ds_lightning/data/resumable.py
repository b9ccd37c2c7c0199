"""Where training stands in its data, so that a restored run goes on with the very next sample.

An epoch's order is a function of the seed and the epoch only. Every micro-step takes the next slice of it, and each
data-parallel rank its share of that slice (:class:`~ds_lightning.data.share_sampler.ShareBatchSampler`). The position
is counted in samples, so a run restored on another number of processes continues at the same sample.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from ds_lightning.data.share_plan import SharePlan
from ds_lightning.data.share_sampler import ShareBatchSampler

__all__ = [
    "DataCursor",
    "ResumableDataLoader",
    "position_loader",
    "position_under",
    "rebuild_loader",
    "resumable_loader",
]


class DataCursor:
    """A resume point: the next iteration of the training data starts ``samples`` into ``epoch``'s order, once."""

    def __init__(self) -> None:
        self._pending: tuple[int, int] | None = None

    def resume_at(self, epoch: int, samples: int) -> None:
        """Make the next iteration start ``samples`` into ``epoch``."""
        self._pending = (int(epoch), int(samples))

    def clear(self) -> None:
        """Forget a resume point nobody used."""
        self._pending = None

    def take(self) -> tuple[int, int] | None:
        """The pending ``(epoch, samples)``, cleared as it is read."""
        pending, self._pending = self._pending, None
        return pending


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ShareBatchSampler`, whose state records how its order was drawn.

    Lightning saves the state of loaders that have one and, on resume, hands it back; a seed or shuffle that changed
    between the runs means the restored position points into another order, which is worth a warning.
    """

    def state_dict(self) -> dict[str, Any]:
        """How the order is drawn: seed, shuffle and dataset size."""
        sampler = self.batch_sampler
        assert isinstance(sampler, ShareBatchSampler)
        return {"seed": sampler.seed, "shuffle": sampler.shuffle, "num_samples": sampler.num_samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Warn when the saved order differs from this one."""
        sampler = self.batch_sampler
        assert isinstance(sampler, ShareBatchSampler)
        now = {"seed": sampler.seed, "shuffle": sampler.shuffle, "num_samples": sampler.num_samples}
        changed = {k: (state_dict[k], now[k]) for k in now if k in state_dict and state_dict[k] != now[k]}
        if changed:
            warnings.warn(
                f"The restored run draws its training data differently ({changed}, saved then current): it goes on"
                " from the saved position in another order. Keep the seed, shuffle and dataset to resume exactly.",
                stacklevel=2,
            )


def rebuild_loader(loader: DataLoader, batch_sampler: Any, cls: type[DataLoader] = ResumableDataLoader) -> DataLoader:
    """``loader``'s dataset, workers and collation, drawing its batches from ``batch_sampler``."""
    workers = loader.num_workers
    return cls(
        loader.dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers if workers else False,
    )


def _order_of(loader: DataLoader) -> tuple[bool, int]:
    sampler = getattr(loader, "sampler", None)
    shuffle = bool(getattr(sampler, "shuffle", isinstance(sampler, RandomSampler)))
    # Lightning seeds its DistributedSampler from seed_everything's seed; one process has no such sampler.
    seed = int(getattr(sampler, "seed", os.environ.get("PL_GLOBAL_SEED", 0)))
    return shuffle, seed


def resumable_loader(loader: Any, rank: int, world_size: int, cursor: DataCursor) -> Any:
    """``loader`` drawing a world-size-independent order that ``cursor`` can start mid-epoch.

    A loader already on a :class:`ShareBatchSampler` (the load balancer's) only gains the cursor. A map-style loader
    is rebuilt: every micro-step takes the next ``batch_size x world_size`` samples of the epoch's order, this rank
    its slice. An iterable-style loader cannot be positioned; it is returned unchanged, with a warning.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, ShareBatchSampler):
        batch_sampler.cursor = cursor
        return loader if isinstance(loader, ResumableDataLoader) else rebuild_loader(loader, batch_sampler)
    dataset = getattr(loader, "dataset", None)
    size = getattr(loader, "batch_size", None)
    if not isinstance(loader, DataLoader) or isinstance(dataset, IterableDataset) or not isinstance(size, int):
        warnings.warn(
            f"BackupAndRestore cannot position the training data ({type(loader).__name__} over"
            f" {type(dataset).__name__}): a restored run starts its epoch's data again. Return a map-style DataLoader"
            " with an integer batch_size from train_dataloader() to resume at the exact sample.",
            stacklevel=2,
        )
        return loader
    assert dataset is not None  # a DataLoader always has one
    shuffle, seed = _order_of(loader)
    plan = SharePlan(size * world_size, world_size, min_share=0.0, ema=1.0, hysteresis=0.0)
    sampler = ShareBatchSampler(len(dataset), plan, rank, shuffle=shuffle, seed=seed, first_batch=_zero)
    sampler.cursor = cursor
    return rebuild_loader(loader, sampler)


def _zero() -> int:
    return 0


def position_loader(strategy: Any, dataloader: Any, cursor: DataCursor | None, training: bool) -> Any:
    """What a strategy's ``process_dataloader`` returns for the training data when a cursor is set."""
    if cursor is None or not training:
        return dataloader
    kwargs: dict[str, Any] = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return resumable_loader(dataloader, int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1)), cursor)


def position_under(strategy: Any, cursor: DataCursor) -> Callable[[], None]:
    """Have a strategy without a ``data_cursor`` of its own (Lightning's) position the training data; return the undo.

    Its ``process_dataloader``, the last step every loader takes before the loop, is wrapped on the instance: the
    training loader is rebuilt over the same world-size-independent order a ds strategy draws (the replicas and rank
    from its ``distributed_sampler_kwargs``, one process without them), so a backup restores under the default
    one-device strategy or ``ddp`` at the exact sample, and the restored loader has the state the backup's loop saved.
    """
    own = vars(strategy).get("process_dataloader")  # an earlier wrap on this instance, put back by the undo
    original = strategy.process_dataloader

    def process_dataloader(dataloader: Any) -> Any:
        dataloader = original(dataloader)
        module = strategy.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return position_loader(strategy, dataloader, cursor, trainer is not None and trainer.training)

    strategy.process_dataloader = process_dataloader

    def undo() -> None:
        if own is None:
            vars(strategy).pop("process_dataloader", None)
        else:
            strategy.process_dataloader = own

    return undo
