"""The pipeline's precision: the Trainer's 32-bit or bf16 plugin, with norm clipping over every stage of a pipeline."""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["GlobalNormPrecision", "check_pipeline_precision"]


def check_pipeline_precision(plugin: Precision) -> Precision:
    """The Trainer's precision plugin, if ds_pipeline runs it: 32-bit, ``bf16-mixed`` or ``bf16-true``.

    Raises:
        ValueError: for any other precision, naming it and the choices.

    """
    inner = plugin.inner if isinstance(plugin, GlobalNormPrecision) else plugin
    bf16_mixed = isinstance(inner, MixedPrecision) and inner.precision == "bf16-mixed" and inner.scaler is None
    bf16_true = isinstance(inner, HalfPrecision) and inner.precision == "bf16-true"
    if type(inner) is Precision or bf16_mixed or bf16_true:
        return inner
    name = getattr(inner, "precision", type(inner).__name__)
    raise ValueError(
        f"ds_pipeline runs in precision '32-true', 'bf16-mixed' or 'bf16-true', but the Trainer chose {name!r}; "
        "use Trainer(precision='bf16-mixed') for reduced precision (fp16 needs a loss scaler shared by every stage, "
        "which the pipeline does not have)."
    )


class GlobalNormPrecision(Precision):
    """The Trainer's precision plugin, except that norm clipping uses the norm over all stages of the pipeline.

    Casting, autocast and the optimizer step are the inner plugin's; clipping by norm sums the squared norms of every
    stage's gradients over the pipeline's group first, so it clips as the unsplit model would. A tied weight's copies
    on later stages hold the same (summed) gradient as the first copy, so they are left out of the norm.

    Args:
        group: the process group of one pipeline replica's stages.
        inner: the Trainer's plugin (32-bit, ``bf16-mixed`` or ``bf16-true``).
        duplicates: parameters whose gradients another stage already counts (the later copies of tied weights).

    """

    def __init__(
        self, group: dist.ProcessGroup, inner: Precision | None = None, duplicates: Iterable[nn.Parameter] = ()
    ) -> None:
        super().__init__()
        self._group = group
        self.inner = inner if inner is not None else Precision()
        self.precision = self.inner.precision
        self._duplicates = {id(p) for p in duplicates}

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.inner.convert_module(module)

    @override
    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self.inner.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.inner.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.inner.forward_context()

    @contextmanager
    def schedule_context(self) -> Generator[None, None, None]:
        """Where the pipeline schedule runs forward and backward: the inner plugin's autocast or default dtype."""
        with self.inner.forward_context():
            yield

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        counted = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and id(p) not in self._duplicates
        ]
        device = grads[0].device if grads else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in counted:
            squares += torch.linalg.vector_norm(grad.detach(), 2.0).float() ** 2
        dist.all_reduce(squares, group=self._group)
        # Same formula as torch.nn.utils.clip_grad_norm_.
        coefficient = torch.clamp(float(clip_val) / (squares.sqrt() + 1e-6), max=1.0)
        for grad in grads:
            grad.detach().mul_(coefficient.to(grad.device, grad.dtype))
