"""Measure each layer's compute time and memory on a sample batch, the inputs of ``balance="auto"``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ds_lightning.pipeline.partition import partition_by_cost, resolve_balance, stage_layer_ranges

__all__ = ["LayerProfile", "auto_balance", "profile_layers"]


@dataclass(frozen=True)
class LayerProfile:
    """Cost of one layer on the sample batch.

    Attributes:
        seconds: median forward + backward time.
        parameter_bytes: bytes of the layer's parameters and their gradients.
        activation_bytes: bytes of the layer's output, which the pipeline keeps until the backward pass.

    """

    seconds: float
    parameter_bytes: int
    activation_bytes: int

    @property
    def memory_bytes(self) -> int:
        """Parameters, gradients and the saved output."""
        return self.parameter_bytes + self.activation_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(
    layers: Sequence[nn.Module], sample: torch.Tensor, device: torch.device, repeats: int = 5
) -> list[LayerProfile]:
    """Time forward + backward of every layer in turn, feeding each the previous layer's output.

    Layers are moved to ``device`` for the measurement and moved back afterwards; their gradients are left as they
    were. The first of ``repeats`` passes is a warm-up and not counted.
    """
    if repeats < 2:
        raise ValueError(f"repeats={repeats} must be >= 2 (the first pass is a warm-up).")
    profiles = []
    x = sample.to(device)
    for layer in layers:
        home = next(layer.parameters(), torch.empty(0)).device
        saved_grads = [p.grad for p in layer.parameters()]
        for p in layer.parameters():
            p.grad = None  # backward would add into the saved gradient tensors in place
        layer.to(device)
        timings = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            _sync(device)
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            _sync(device)
            timings.append(time.perf_counter() - start)
        param_bytes = sum(2 * p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
        profiles.append(
            LayerProfile(
                seconds=statistics.median(timings[1:]),
                parameter_bytes=param_bytes,
                activation_bytes=out.numel() * out.element_size(),
            )
        )
        layer.to(home)
        for p, g in zip(layer.parameters(), saved_grads, strict=True):
            p.grad = g  # after moving home: the saved gradients live there
        x = out.detach()
    return profiles


def auto_balance(
    layers: Sequence[nn.Module],
    sample: torch.Tensor,
    device: torch.device,
    n_stages: int,
    agree: Callable[[list[float]], list[float]] | None = None,
) -> tuple[list[int], str]:
    """``balance="auto"``: profile every layer on ``sample`` and split them to minimise the slowest stage.

    Args:
        layers: the ``nn.Sequential``'s layers.
        sample: the input of the first layer.
        device: where to time them.
        n_stages: stages to split into.
        agree: turns this process's per-layer seconds into the ones every process uses (e.g. their average), so
            that every rank chooses the same split.

    Returns:
        The layers of each stage, and a one-line table of each stage's layers, time and memory for the log.

    Raises:
        ValueError: if there are more stages than layers.

    """
    resolve_balance(len(layers), n_stages, None)
    profiles = profile_layers(layers, sample, device)
    costs = [p.seconds for p in profiles]
    if agree is not None:
        costs = agree(costs)
    balance = partition_by_cost(costs, n_stages)
    table = ", ".join(
        f"stage {s}: layers {r.start}-{r.stop - 1} {sum(costs[i] for i in r) * 1e3:.2f} ms "
        f"{sum(profiles[i].memory_bytes for i in r) / 2**20:.1f} MiB"
        for s, r in enumerate(stage_layer_ranges(balance))
    )
    return balance, table
