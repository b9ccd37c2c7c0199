"""Worker for ``torch.multiprocessing.spawn``: ``StepAgreement`` on 3 gloo processes without Lightning."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ds_lightning.backup.agreement import StepAgreement
from tests.helpers.dist_workers import _init


def agree_over_steps(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 raises flag 0 at step 3 and rank 2 flag 1 at step 5; each step also all-reduces a gradient-like tensor.

    Saves what every step's ``collect`` returned on this rank.
    """
    _init(rank, world, port)
    try:
        agreement = StepAgreement(timeout=30.0)
        seen = []
        for step in range(8):
            grad = torch.ones(1000)
            dist.all_reduce(grad)  # the training step's own collective, issued while the agreement is in flight
            seen.append(agreement.collect(2))
            agreement.start((rank == 1 and step == 3, rank == 2 and step == 5), torch.device("cpu"), collective=True)
        torch.save({"seen": seen, "grad": float(grad[0])}, f"{out}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()
