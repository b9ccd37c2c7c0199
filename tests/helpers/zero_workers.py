"""Worker functions for ``torch.multiprocessing.spawn``: ds_lightning.sharding on gloo without Lightning."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from ds_lightning.sharding import consolidated_state, load_sharded_states, optimizer_state_bytes, shard_optimizers
from tests.helpers.dist_workers import _init


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def scheduler_drives_the_sharded_step(rank: int, world: int, port: int, out: str) -> None:
    """An SGD step of gradient 1 moves every parameter by exactly the scheduler's lr, on every rank's shard."""
    _init(rank, world, port)
    try:
        model = _model()
        plain = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
        (sharded,) = shard_optimizers([plain], [SimpleNamespace(scheduler=scheduler)])
        moves, local_lrs = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                before = [p.detach().clone() for p in model.parameters()]
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
                sharded.step()
                scheduler.step()
                after = list(model.parameters())
                moves.append(sorted({round(float((b - p).abs().max()), 6) for b, p in zip(before, after, strict=True)}))
                local_lrs.append(sharded.optim.param_groups[0]["lr"])
        # Adam state to check the consolidated layout and the round trip through a checkpoint.
        adam_model = _model()
        adam = torch.optim.Adam(adam_model.parameters(), lr=0.01)
        (zero,) = shard_optimizers([adam], [])
        for _ in range(2):
            for p in adam_model.parameters():
                p.grad = torch.full_like(p, 0.5)
            zero.step()
        whole = consolidated_state(zero, writer=rank == 0)
        shard_bytes = optimizer_state_bytes(zero)
        saved: list = [whole]
        dist.broadcast_object_list(saved, src=0)
        load_sharded_states([zero], saved)
        after_load = optimizer_state_bytes(zero)
        result = {
            "moves": moves,
            "local_lrs": local_lrs,
            "warnings": [str(w.message) for w in caught],
            "whole": whole,
            "shard_bytes": shard_bytes,
            "bytes_after_load": after_load,
            "wrapper_state_after_load": len(zero.state),
            "checkpoint_untouched": all(v is not None for v in saved[0]["state"].values()),
        }
        torch.save(result, f"{out}.rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
