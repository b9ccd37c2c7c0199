"""``DynamicLoadBalancer``: size each rank's batch to its measured speed, so a slow device stops holding back DDP."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.callbacks._step_clock import ClockedCallback
from ds_lightning.data.resumable import rebuild_loader
from ds_lightning.data.share_plan import SharePlan, split_sizes
from ds_lightning.data.share_sampler import ShareBatchSampler
from ds_lightning.diagnostics.step_times import step_clock
from ds_lightning.strategies.capabilities import capabilities_of

__all__ = ["DynamicLoadBalancer"]

_WARMUP_BATCHES = 2


class DynamicLoadBalancer(ClockedCallback):
    """Divide a fixed global batch among ``ds_mirrored`` ranks in proportion to each rank's measured speed.

    Synchronous data parallelism waits for the slowest device every step. The balancer measures each rank's compute
    throughput (samples/s over the compute phase of :mod:`ds_lightning.diagnostics.step_times`: from the start of the
    batch until its last gradient is ready, so time spent waiting in the all-reduce is not counted; the same clock
    ``DistributedReport`` reads, so the two never time a step twice), smooths it with an exponential moving average,
    and every ``interval`` batches re-divides ``global_batch_size`` so that every rank needs about the same time.
    Shares keep at least ``min_share`` of the batch and change only when some rank's size would move by more than
    ``hysteresis``.

    Guarantees: every rank runs the same number of steps per epoch (so DDP cannot hang), every sample is drawn once
    per epoch, and gradients are weighted by each rank's share in the comm hook (composing with
    ``gradient_compression``), so the synchronised gradient is the mean over the global batch, as if one device had
    run it. Use a loss that is a mean over the batch.

    The training DataLoader is rebuilt around :class:`ShareBatchSampler` with the original dataset, collate function
    and workers; it must be map-style (have ``__len__``). The DataLoader's own batch size is then unused.

    Logged every ``interval`` batches, identical on every rank: ``balance/share_rank{r}`` and
    ``balance/throughput_rank{r}`` (samples/s). Shares and the estimates are saved in checkpoints.

    Args:
        global_batch_size: samples per step over all ranks; ``None`` takes the training DataLoader's (per-rank)
            batch size times the number of data-parallel ranks, read when the loader is built.
        interval: batches between re-divisions; 0 keeps ``initial_shares`` fixed.
        ema: weight of the newest measurement in the running estimate, in ``(0, 1]``.
        hysteresis: relative size change below which shares stay as they are, in ``[0, 1]``.
        min_share: the smallest fraction of the global batch any rank keeps, in ``(0, 1/world_size]``.
        initial_shares: starting fractions per rank (normalised); ``None`` starts even.

    Raises:
        ValueError: for an out-of-range option, naming the value and the fix.

    """

    def __init__(
        self,
        global_batch_size: int | None = None,
        interval: int = 20,
        ema: float = 0.5,
        hysteresis: float = 0.05,
        min_share: float = 0.05,
        initial_shares: list[float] | None = None,
    ) -> None:
        if global_batch_size is not None:
            check.integer("global_batch_size", global_batch_size, 2, "DynamicLoadBalancer(global_batch_size=256)")
        check.integer("interval", interval, 0, "DynamicLoadBalancer(interval=20)", "0 keeps the initial shares")
        check.number("ema", ema, "DynamicLoadBalancer(ema=0.5)", above=0, at_most=1)
        check.number("hysteresis", hysteresis, "DynamicLoadBalancer(hysteresis=0.05)", at_least=0, at_most=1)
        check.number("min_share", min_share, "DynamicLoadBalancer(min_share=0.05)", above=0, at_most=1)
        check.positive_numbers(
            "initial_shares", initial_shares, "DynamicLoadBalancer(initial_shares=[3, 1]), one per rank"
        )
        self.global_batch_size = global_batch_size
        self.interval = interval
        self.ema = float(ema)
        self.hysteresis = float(hysteresis)
        self.min_share = float(min_share)
        self.initial_shares = list(initial_shares) if initial_shares is not None else None
        self.plan: SharePlan | None = None
        self._world = 1
        self._pending_state: dict[str, Any] | None = None  # restored before the plan exists (global batch from loader)
        self.batches = 0  # batches run in this fit, over all epochs
        self._epoch_start = 0
        self._strategy: Any = None
        self._rank = 0
        self._lag = 2
        self._size = 0
        self._busy = 0.0
        self._samples = 0
        self._seen = 0  # batches since this fit started, to skip the warm-up ones

    # --- set-up -----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        world = int((getattr(strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1))
        name = getattr(strategy, "strategy_name", None) or type(strategy).__name__
        why = {
            "ds_parameter_server": "asynchronous workers already run at their own pace (fast ones take more steps);"
            " the balancer is for synchronous data parallelism",
            "ds_pipeline": "the stages of a pipeline must all see the same batch",
        }.get(name)
        if why is None and world < 2:
            rank_zero_warn("DynamicLoadBalancer has one data-parallel process to balance; it does nothing.")
            return
        if why is not None or not capabilities_of(strategy).weights_rank_gradients:
            why = why or "it resizes batches through ds_mirrored's data loading and gradient hook"
            raise MisconfigurationException(
                f"DynamicLoadBalancer cannot run under {name}: {why}. Use strategy='ds_mirrored', or remove the"
                " callback."
            )
        if self.initial_shares is not None and len(self.initial_shares) != world:
            raise MisconfigurationException(
                f"DynamicLoadBalancer(initial_shares={self.initial_shares}) names {len(self.initial_shares)} ranks,"
                f" but this run has {world}; give one share per rank."
            )
        self.plan, self._world, self._strategy, self._rank = None, world, strategy, trainer.global_rank
        step_clock(trainer).reset()
        self.batches, self._epoch_start, self._seen, self._pending_state = 0, 0, 0, None
        if self.global_batch_size is not None:
            self.plan = self._make_plan(self.global_batch_size)
        self._strategy.balance_batches(self._train_loader)  # weights_rank_gradients promises it

    def _make_plan(self, global_batch_size: int) -> SharePlan:
        world = self._world
        plan = SharePlan(global_batch_size, world, self.min_share, self.ema, self.hysteresis)
        if plan.min_size * world > global_batch_size:
            raise MisconfigurationException(
                f"DynamicLoadBalancer(global_batch_size={global_batch_size}) cannot give {world} ranks at least"
                f" min_share={self.min_share} each; raise global_batch_size or lower min_share."
            )
        if self.initial_shares is not None:
            plan.changes = [(0, split_sizes(global_batch_size, self.initial_shares, plan.min_size))]
        return plan

    def _train_loader(self, loader: Any) -> DataLoader:
        if self.plan is None:  # global_batch_size=None: the loader's per-rank batch on every rank
            if not isinstance(loader.batch_size, int):
                raise MisconfigurationException(
                    "DynamicLoadBalancer() reads the global batch from the training DataLoader's batch_size, but it is"
                    f" {loader.batch_size!r}; pass global_batch_size, e.g. DynamicLoadBalancer(global_batch_size=64)."
                )
            self.plan = self._make_plan(loader.batch_size * self._world)
            if self._pending_state is not None:
                self.load_state_dict(self._pending_state)
        dataset = loader.dataset
        if not hasattr(dataset, "__len__") or isinstance(dataset, torch.utils.data.IterableDataset):
            raise MisconfigurationException(
                "DynamicLoadBalancer needs a map-style training dataset (with __len__ and indexing) to hand each rank"
                f" its share; got {type(dataset).__name__}."
            )
        sampler = getattr(loader, "sampler", None)
        batch_sampler = ShareBatchSampler(
            len(dataset),
            self.plan,
            self._rank,
            shuffle=bool(getattr(sampler, "shuffle", False)),
            seed=int(getattr(sampler, "seed", 0)),
            first_batch=lambda: self._epoch_start,
        )
        workers = loader.num_workers
        # The loader may read this far ahead: a new plan starts after it, so no batch mixes two plans.
        self._lag = 2 + (workers * (loader.prefetch_factor or 2) if workers else 0)
        return rebuild_loader(loader, batch_sampler)

    # --- measuring and weighting ------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run restored mid-epoch gets no on_train_epoch_start: its epoch began this many batches ago.
        # Lightning builds `current` as a _ProcessedTracker but declares its base class, which lacks `processed`.
        processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
        self._epoch_start = self.batches - processed
        if self._strategy is not None:
            self.watch_gradients(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = self.batches
        super().on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.plan is None:
            return
        sampler = trainer.train_dataloader.batch_sampler  # type: ignore[union-attr]
        assert isinstance(sampler, ShareBatchSampler), "the training DataLoader was not rebuilt by the balancer"
        global_batch = self.plan.global_batch_size
        total = min(global_batch, sampler.num_samples - idx * global_batch)
        sizes = sampler.sizes(self.batches, total)
        self._size = sizes[self._rank]
        self._strategy.gradient_weight = len(sizes) * self._size / sum(sizes)
        super().on_train_batch_start(trainer, pl_module, batch, idx)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.plan is None:
            return
        clock = step_clock(trainer)
        step = clock.batch_end() or clock.last  # closed here, or already by another callback on the same clock
        self._seen += 1
        if step is not None and self._seen > _WARMUP_BATCHES:  # the first build DDP's buckets and warm caches
            self._busy += step.compute_ns / 1e9
            self._samples += self._size
        self.batches += 1
        if not self.interval or self.batches % self.interval:
            return
        if not self._samples:
            return  # nothing measured yet (warm-up); every rank skips alike, so no collective is missed
        mine = torch.tensor([self._samples / max(self._busy, 1e-9)], dtype=torch.float64)
        gathered = trainer.strategy.all_gather(mine.to(trainer.strategy.root_device)).reshape(-1).cpu().tolist()
        self._busy, self._samples = 0.0, 0
        # New sizes start on an accumulation-window boundary, so every micro-batch of a window has one weight.
        window = max(1, int(trainer.accumulate_grad_batches))
        self.plan.observe(gathered, now=self.batches, lag=self._lag, window=window, origin=self._epoch_start)
        logged = {f"balance/throughput_rank{r}": float(t) for r, t in enumerate(gathered)}
        logged.update(
            {f"balance/share_rank{r}": size / self.plan.global_batch_size for r, size in enumerate(self.plan.latest)}
        )
        pl_module.log_dict(logged, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)

    # --- checkpoints ------------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.state_dict() if self.plan is not None else None, "batches": self.batches}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict.get("plan"):
            return
        if self.plan is None:
            self._pending_state = state_dict  # applied once the loader gives the global batch size
            return
        self.plan.load_state_dict(state_dict["plan"])
        self.batches = int(state_dict.get("batches", 0))
        self._pending_state = None
