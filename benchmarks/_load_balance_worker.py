"""One load-balance benchmark run: the digits classifier on 2 CPU processes under ds_mirrored + DynamicLoadBalancer.

Started by ``benchmarks/load_balance.py`` with a JSON spec; Lightning re-runs this script for every rank. Both
configurations go through the balancer's data path: ``interval=0`` keeps the equal split ``initial_shares=[1, 1]``,
``interval > 0`` re-divides the global batch by measured throughput. Rank ``slow_rank`` sleeps ``delay_per_sample``
seconds per sample of its share inside ``training_step`` (so the balancer counts the sleep as compute).

Every rank writes ``result.{r}.json`` into the spec's ``out_dir``: per epoch its wall time (epoch start to the end
of its last batch), per step its time (batch start to batch end), local batch size and compute time (batch start to
the launch of its last gradient bucket, the balancer's own measure); rank 0 adds the per-step sizes of every rank
(``plan.sizes_at``), the final sizes and throughput estimates, and the validation accuracy of the final parameters.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ds_lightning
from benchmarks.harness.timing import StepTimer
from ds_lightning.callbacks import DynamicLoadBalancer
from ds_lightning.demos import DigitsClassifier, DigitsDataModule


class SlowClassifier(DigitsClassifier):
    """The digits classifier; on ``slow_rank`` every ``training_step`` first sleeps ``delay_per_sample`` per sample."""

    def __init__(self, slow_rank: int, delay_per_sample: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slow_rank = slow_rank
        self.delay_per_sample = delay_per_sample

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.slow_rank and self.delay_per_sample > 0:
            time.sleep(self.delay_per_sample * int(batch[0].shape[0]))
        return super().training_step(batch, batch_idx)


class Clock(StepTimer):
    """The harness's step and epoch clock, plus each step's compute up to the launch of its last gradient bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.compute_ms: list[float] = []
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        end = time.perf_counter()
        # Set by ds_mirrored's gradient hook while a balancer weights gradients: the end of this rank's compute,
        # before it waits for the other rank in the all-reduce.
        launched = trainer.strategy.last_bucket_time
        self.compute_ms.append(1000 * ((launched if launched > self._start else end) - self._start))
        self.sizes.append(int(batch[0].shape[0]))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pl.seed_everything(spec["seed"], verbose=False)
    balancer = DynamicLoadBalancer(
        global_batch_size=spec["global_batch_size"],
        interval=spec["interval"],
        initial_shares=[1.0, 1.0],
    )
    clock = Clock()
    data = DigitsDataModule(batch_size=spec["global_batch_size"] // 2, seed=0)
    data.setup("fit")
    assert data.train_set is not None and data.val_set is not None
    limits: dict[str, Any] = {"max_epochs": spec["epochs"]}
    if spec.get("limit_train_batches"):
        limits["limit_train_batches"] = spec["limit_train_batches"]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ds_lightning.MirroredStrategy(timeout=spec["dist_timeout"]),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[clock, balancer],
        **limits,
    )
    # The balancer rebuilds this loader around its own batch sampler; its batch size (the equal split) is unused.
    loader = DataLoader(data.train_set, batch_size=spec["global_batch_size"] // 2, shuffle=True)
    model = SlowClassifier(
        spec["slow_rank"], spec["delay_per_sample"], hidden_sizes=spec["hidden"], lr=spec["lr"], momentum=0.9
    )
    trainer.fit(model, train_dataloaders=loader)
    rank = trainer.global_rank
    record: dict[str, Any] = {
        "rank": rank,
        "epoch_s": clock.epoch_s,
        "step_ms": clock.step_ms,
        "compute_ms": clock.compute_ms,
        "local_sizes": clock.sizes,
    }
    if rank == 0:
        plan = balancer.plan
        assert plan is not None
        record["sizes"] = [list(plan.sizes_at(i)) for i in range(balancer.batches)]
        record["final_sizes"] = list(plan.latest)
        record["estimate"] = plan.estimate
        x, y = data.val_set.tensors
        model.eval()
        with torch.no_grad():
            record["final_acc"] = float((model(x).argmax(-1) == y).float().mean())
    Path(spec["out_dir"], f"result.{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
