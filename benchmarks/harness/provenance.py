"""Where a result comes from (commit, date, machine, versions): recorded in every results JSON, shown by the docs."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from .run import package_state


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's name (``model name`` in ``/proc/cpuinfo``), else ``platform.processor()``; None if neither."""
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() or None
    return platform.processor() or None


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _cores() -> int | None:
    """The cores this process may run on (its affinity: a container's share), else the machine's count."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def provenance() -> dict[str, Any]:
    """The commit, the UTC date, the CPU model and cores, and the versions; a field that cannot be read is None."""
    import torch  # imported here so the harness's pure parts do not

    package = package_state()
    return {
        "commit": package["commit"] or None,
        "uncommitted": package["uncommitted"],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cores": _cores(),
        "machine": platform.machine() or None,
        "torch": torch.__version__,
        "lightning": _version("lightning") or _version("pytorch-lightning"),
        "python": platform.python_version(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
