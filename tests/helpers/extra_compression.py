"""A compression method added from outside the package: one class, one ``register`` call (see docs/design.md).

``fp64_test`` all-reduces gradients in float64. As a :class:`~ds_lightning.comm.compression.none.Dense` method it also
gets, with no further code, the two-level inter-host stage and parameter-server pushes at that width.

Usage: ``python -m tests.helpers.extra_compression OUT``, started once per rank (``tests.helpers.runner.run_ranks``):
registers the method, trains ds_mirrored with ``gradient_compression="fp64_test"`` on 2 gloo ranks and writes
``{OUT}.rank{R}.pt``. Tests register it with :func:`register` and remove it again, so the names listed in other tests'
error messages stay the built-in ones.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.

import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import ds_lightning
from ds_lightning.comm.compression import register
from ds_lightning.comm.compression.base import Hook
from ds_lightning.comm.compression.none import Dense, PlainState
from ds_lightning.comm.wire import WireLog

NAME = "fp64_test"
STEPS, BATCH, LR = 6, 4, 0.1  # per rank: 2 ranks x 4 samples = a global batch of 8


def _fp64_hook(state: PlainState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    send = buffer.to(torch.float64).div_(dist.get_world_size(state.process_group))
    state.wire.record(send)
    dist.all_reduce(send, group=state.process_group)
    buffer.copy_(send)
    if bucket.is_last():
        state.wire.end_step()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


class Float64(Dense):
    """Gradients all-reduced (and pushed) in float64."""

    name = NAME
    wire_dtype = torch.float64

    def ddp_hook(
        self, process_group: dist.ProcessGroup | None, model: DistributedDataParallel, wire: WireLog, warmup: bool
    ) -> tuple[Any, Hook]:
        """The hook above, on a plain state."""
        return PlainState(process_group, wire), _fp64_hook


def data() -> TensorDataset:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    return TensorDataset(x, (x[:, :3] * 2).argmax(1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


class Net(pl.LightningModule):
    """The model above; it keeps every batch it trained on, for the test's single-process reference."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.batches.append((x.clone(), y.clone()))
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


def main(out: str) -> None:
    register(Float64)
    torch.set_num_threads(1)
    net = Net()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ds_lightning.MirroredStrategy(gradient_compression=NAME),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(net, DataLoader(data(), batch_size=BATCH, shuffle=False))
    strategy: Any = trainer.strategy
    wire = strategy._compressor.wire
    record = {
        "params": {k: v.detach().clone() for k, v in net.net.state_dict().items()},
        "batches": net.batches,
        "global_step": trainer.global_step,
        "steps": wire.steps,
        "dtypes": sorted(wire.dtypes),
        "bytes_per_step": strategy.comm_bytes_per_step,
        "uncompressed_bytes_per_step": strategy.uncompressed_bytes_per_step,
    }
    torch.save(record, f"{out}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
