"""Free bytes per device slot, what ``device_map="auto"`` balances against."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence

import torch

__all__ = ["free_bytes"]


def _host_available() -> int:
    # MemAvailable counts reclaimable page cache, which is what a new allocation can use; free pages alone undercount.
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 50  # unknown: no capacity limit, and equal shares between CPU slots


def free_bytes(devices: Sequence[torch.device]) -> list[int]:
    """Free memory of each slot: ``torch.cuda.mem_get_info`` on a GPU, the host's available memory on the CPU.

    A device listed in several slots shares its free memory equally between them.

    Raises:
        ValueError: for a device type whose free memory we cannot read, naming the fix.

    """
    slots = Counter(devices)
    free = []
    for device in devices:
        if device.type == "cuda":
            available = torch.cuda.mem_get_info(device)[0]
        elif device.type == "cpu":
            available = _host_available()
        else:
            raise ValueError(
                f"device_map='auto' reads free memory on 'cuda' and 'cpu' devices, not {str(device)!r}; write an"
                " explicit device_map for it, e.g. device_map={'blocks.0': '" + str(device) + "', ...}."
            )
        free.append(available // slots[device])
    return free
