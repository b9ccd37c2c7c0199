"""ds_mirrored given DDPStrategy-only arguments, on 2 CPU processes (Lightning relaunches this script per rank).

Usage: ``python -m tests.helpers.dropin_run OUT``. The strategy gets ``broadcast_buffers=False`` (for torch's DDP), a
``timedelta`` timeout and a comm hook of the user's own that counts its calls; each rank writes ``OUT.rank{r}.json``
with what the wrapped model and the hook saw.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at runtime.

import json
import sys
from dataclasses import dataclass
from datetime import timedelta

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import ds_lightning
from tests.helpers.models import TinyData, TinyModule

STEPS = 3


@dataclass
class CountingState:
    calls: int = 0
    last_buckets: int = 0


def counting_hook(state: CountingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.calls += 1
    state.last_buckets += int(bucket.is_last())
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


class Record(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        state = trainer.strategy._ddp_comm_state
        weight = pl_module.layer.weight.detach()
        gathered = [torch.zeros_like(weight) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, weight)
        record = {
            "wrapped": isinstance(model, DistributedDataParallel),
            "broadcast_buffers": getattr(model, "broadcast_buffers", None),
            "hook_calls": state.calls,
            "hook_steps": state.last_buckets,
            "timeout": trainer.strategy._timeout.total_seconds(),
            "replicas_equal": all(torch.equal(g, gathered[0]) for g in gathered),
            "global_step": trainer.global_step,
        }
        with open(f"{self.out}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(record, f)


def main(out: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    strategy = ds_lightning.MirroredStrategy(
        ddp_comm_state=CountingState(),
        ddp_comm_hook=counting_hook,
        timeout=timedelta(seconds=120),
        broadcast_buffers=False,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Record(out)],
        default_root_dir=out + ".root",
    )
    trainer.fit(TinyModule(), datamodule=TinyData())


if __name__ == "__main__":
    main(sys.argv[1])
