"""``MixedPrecision("auto")`` on 2 ``ds_mirrored`` CPU processes: do the ranks agree when their timings disagree?

Usage: ``python -m tests.helpers.precision_runs OUT`` on every rank (started together, as torchrun would). Five fits
in one process group, each with a fresh callback; in the first three the timing seam returns figures that depend on
the rank (and records the arguments it was called with), in the last two the real passes are timed (under DDP, then
under the fsdp2 engine). Each rank writes
``OUT.rank{r}.json``: per fit, the choice, the agreed figures, the seam's calls, and the autocast state of every
training step.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import ds_lightning
from ds_lightning.callbacks import MixedPrecision
from tests.helpers.models import TinyData, TinyModule
from tests.helpers.trainers import quiet_trainer

STEPS = 2
PASSES = 5
MS = 1e-3
#: per fit, rank 0's and rank 1's bf16 milliseconds per pass (fp32 takes 10 ms everywhere); ``None``: really timed
FITS: dict[str, tuple[float, float] | None] = {
    "rank1_favours_bf16": (30.0, 5.0),  # alone, rank 1 would pick bf16; rank 0's slower bf16 decides: fp32
    "rank0_favours_bf16": (5.0, 30.0),  # the mirror image: a choice copied from rank 0 would be bf16
    "both_favour_bf16": (5.0, 8.0),  # bf16 on both, at the slowest rank's 8 ms
    "measured": None,
    "measured_fsdp2": None,  # the timing passes go through FSDP2's sharded root (it gathers the parameters)
}


class AutocastSeen(TinyModule):
    """TinyModule recording, per training step, whether autocast was on; the timing passes' calls are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []
        self._last = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._last = torch.is_autocast_enabled("cpu")
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(self._last)  # the step's own training_step ran last


def fake_timing(rank: int, bf16_ms: tuple[float, float], calls: list[dict[str, Any]]) -> Any:
    """A seam that records its arguments and returns this rank's figures (no pass runs)."""

    def timing(run_pass: Any, candidates: Sequence[str], passes: int, device: torch.device) -> dict[str, list[float]]:
        calls.append(
            {"candidates": list(candidates), "passes": passes, "device": device.type, "callable": callable(run_pass)}
        )
        return {"fp32": [10.0 * MS] * passes, "bf16": [bf16_ms[rank] * MS] * passes}

    return timing


def fit_once(name: str, bf16_ms: tuple[float, float] | None, root: str) -> dict[str, Any]:
    sharded = {"shard_optimizer_state": True, "sharding_engine": "fsdp2"} if name.endswith("fsdp2") else {}
    strategy = ds_lightning.MirroredStrategy(timeout=timedelta(seconds=120), **sharded)
    amp = MixedPrecision("auto", probe_passes=PASSES)
    calls: list[dict[str, Any]] = []
    if bf16_ms is not None:
        amp.time_candidates = fake_timing(strategy_rank(), bf16_ms, calls)
    model = AutocastSeen()
    trainer = quiet_trainer(
        Path(f"{root}.{name}"), [amp], devices=2, strategy=strategy, max_steps=STEPS, limit_val_batches=0
    )
    trainer.fit(model, datamodule=TinyData())
    assert amp.decision is not None
    return {"chosen": amp.chosen, "decision": amp.decision.as_dict(), "calls": calls, "autocast": model.seen}


def strategy_rank() -> int:
    """This process's rank (set by the launch, like torchrun's)."""
    return int(os.environ["LOCAL_RANK"])


def main(out: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    record = {name: fit_once(name, bf16_ms, out) for name, bf16_ms in FITS.items()}
    with open(f"{out}.rank{strategy_rank()}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
