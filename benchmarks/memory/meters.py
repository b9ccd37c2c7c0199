"""What a memory-benchmark worker reads in its own process: the bytes autograd saves for backward (activations),
the resident set (``/proc/self/status``) and a resettable peak of it, and ``malloc_trim``.

Activations are counted with saved-tensor hooks (the pipeline benchmark's :class:`ActivationMeter`): every tensor
autograd saves during the forward, parameters and their views left out (under parameter sharding those are the
gathered weights, counted as parameters), a tensor saved twice counted once while any save of it is alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.pipeline.worker import ActivationMeter

__all__ = ["counting_activations", "is_parameter", "malloc_trim", "reset_peak_rss", "rss_kib", "status_kib"]


def is_parameter(tensor: torch.Tensor) -> bool:
    """An ``nn.Parameter`` (FSDP2's gathered ones too) or a view of one (a Linear saves its weight transposed)."""
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, nn.Parameter)


def _pack(meter: ActivationMeter, tensor: torch.Tensor) -> Any:
    return tensor if is_parameter(tensor) else meter.pack(frozenset(), tensor)


@contextlib.contextmanager
def counting_activations(meter: ActivationMeter) -> Iterator[None]:
    """Count, in ``meter``, what autograd saves inside the block."""
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, meter), meter.unpack):
        yield


def status_kib(text: str, field: str) -> int:
    """A ``kB`` field (``VmRSS``, ``VmHWM``) of a ``/proc/<pid>/status`` text."""
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(f"{field} is not in the status text")


def rss_kib(field: str = "VmRSS") -> int:
    """This process's resident set now (``VmRSS``) or its peak since the last :func:`reset_peak_rss` (``VmHWM``)."""
    return status_kib(Path("/proc/self/status").read_text(), field)


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current resident set (``clear_refs`` 5, Linux >= 4.0); whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def malloc_trim() -> None:
    """Give freed heap memory back to the system (glibc), so an earlier model's pages do not count against the next."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
