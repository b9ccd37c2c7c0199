"""The link probe of ``gradient_compression="auto"``: timed all-reduces of known sizes, and compression compute.

Every rank runs the same all-reduces in the same order; each rank takes the fastest of its repeats, and one
``MAX`` all-reduce of those medians gives every rank the slowest rank's figures, so all ranks hold identical numbers.
Latency and bandwidth come from a least-squares line through (bytes, seconds), read through the ring model of
:mod:`ds_lightning.comm.auto.model`.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ds_lightning.comm.auto.model import AllReduceFit, LinkFigures

__all__ = ["PROBE_BYTES", "compression_compute", "fit_line", "probe_link"]

PROBE_BYTES: tuple[int, ...] = (4 * 1024, 128 * 1024, 1024 * 1024)
_MIN_LATENCY_S = 1e-7
_MAX_BANDWIDTH = 1e12  # bytes/s: a flat line (noise) reads as this


def _best_seconds(run: Callable[[], object], repeats: int, device: torch.device) -> float:
    # The fastest repeat: other processes' load only ever adds time, so the minimum is the steadiest estimate.
    def timed() -> None:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL and CUDA kernels return before the work is done

    timed()  # warm-up: connection set-up and allocation stay out of the figures
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        timed()
        times.append(time.perf_counter() - start)
    return min(times)


def fit_line(nbytes: Sequence[float], seconds: Sequence[float], world_size: int) -> AllReduceFit:
    """Latency and bandwidth of the ring model from all-reduce times of known sizes (least squares).

    Raises:
        ValueError: with fewer than two distinct sizes.

    """
    if len(set(nbytes)) < 2 or len(nbytes) != len(seconds):
        raise ValueError(f"fitting a line needs times of two or more distinct sizes, got sizes {list(nbytes)}.")
    mean_x, mean_y = statistics.fmean(nbytes), statistics.fmean(seconds)
    sxx = sum((x - mean_x) ** 2 for x in nbytes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(nbytes, seconds, strict=True)) / sxx
    intercept = mean_y - slope * mean_x
    rounds = 2 * max(world_size - 1, 1)
    latency = max(intercept / rounds, _MIN_LATENCY_S)
    bandwidth = min(rounds / max(world_size, 2) / slope, _MAX_BANDWIDTH) if slope > 0 else _MAX_BANDWIDTH
    return AllReduceFit(latency_s=latency, bandwidth=bandwidth)


def compression_compute(
    probes: Mapping[str, Callable[[], object]], device: torch.device, repeats: int = 5
) -> dict[str, float]:
    """Seconds per step of each compression's own compute on this rank, timed on its stand-in work.

    Args:
        probes: per candidate, the work standing in for one step's compression compute
            (:meth:`~ds_lightning.comm.compression.base.Compression.compute_probe`).
        device: where the gradients live.
        repeats: timed repeats (the fastest counts).

    """
    return {name: _best_seconds(run, repeats, device) for name, run in probes.items()}


def probe_link(
    group: dist.ProcessGroup | None,
    device: torch.device,
    compress_s: dict[str, float],
    sizes: Sequence[int] = PROBE_BYTES,
    repeats: int = 5,
) -> LinkFigures:
    """Time all-reduces of ``sizes`` bytes (float32, and float16 at the largest), agree on the slowest rank's times.

    A collective: every rank of ``group`` must call it, with the same ``sizes`` and ``repeats``.

    Args:
        group: the process group gradients are all-reduced over (``None``: the default group).
        device: where the probe tensors live (the gradients' device).
        compress_s: this rank's :func:`compression_compute`; the slowest rank's figure is kept.
        sizes: probe sizes in bytes; two or more distinct ones.
        repeats: timed repeats per size (the fastest counts).

    """
    world = dist.get_world_size(group)
    times = []
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4, device=device)
        times.append(_best_seconds(functools.partial(dist.all_reduce, tensor, group=group), repeats, device))
    half = torch.zeros(max(sizes) // 4, dtype=torch.float16, device=device)  # the largest probe's numbers, halved
    half_s = _best_seconds(lambda: dist.all_reduce(half, group=group), repeats, device)
    names = sorted(compress_s)
    agreed = torch.tensor([*times, half_s, *(compress_s[n] for n in names)], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    values = agreed.tolist()
    float32 = fit_line([float(s) for s in sizes], values[: len(sizes)], world)
    # One latency per link: the half-width path differs in its per-byte cost only (read off the largest size).
    rounds = 2 * max(world - 1, 1)
    per_byte = (values[len(sizes)] - rounds * float32.latency_s) / (max(sizes) / 2)
    half_bandwidth = rounds / max(world, 2) / per_byte if per_byte > 0 else float32.bandwidth
    # Half precision sends half the bytes through the same link, never its bytes faster than float32 does: the cap
    # keeps a noisy reading from crediting fp16 with more than halving the bytes' time.
    half_bandwidth = min(half_bandwidth, float32.bandwidth)
    return LinkFigures(
        world_size=world,
        float32=float32,
        float16=AllReduceFit(latency_s=float32.latency_s, bandwidth=half_bandwidth),
        compress_s=dict(zip(names, values[len(sizes) + 1 :], strict=True)),
    )
