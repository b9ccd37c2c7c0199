"""Gradient-norm clipping over every stage of a pipeline, so it clips as the unsplit model would."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["GlobalNormPrecision"]


class GlobalNormPrecision(Precision):
    """32-bit precision whose norm clipping uses the norm over all stages, like clipping the unsplit model.

    Args:
        group: the process group of one pipeline replica's stages.

    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self._group = group

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            squares += torch.linalg.vector_norm(grad.detach(), 2.0).float() ** 2
        dist.all_reduce(squares, group=self._group)
        # Same formula as torch.nn.utils.clip_grad_norm_.
        coefficient = torch.clamp(float(clip_val) / (squares.sqrt() + 1e-6), max=1.0)
        for grad in grads:
            grad.detach().mul_(coefficient.to(grad.device, grad.dtype))
