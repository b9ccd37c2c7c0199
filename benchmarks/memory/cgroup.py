"""A per-process memory cap from a cgroup (v1 memory controller), for the largest-model ladder.

As root, :class:`RankGroups` makes a child of this process's own memory cgroup for one launch, and under it one group
per rank, each limited to the cap (``memory.limit_in_bytes``): the cap is **per process**. A rank is put in its group
before its interpreter starts (``sh -c 'echo $$ > cgroup.procs; exec python ...'``), so all it allocates counts. The
kernel's OOM killer kills a rank that goes past its cap; ``memory.oom_control``'s ``oom_kill`` counts it.
The machine has no swap, so nothing is paged out instead (``memsw`` left alone).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

__all__ = ["MEMORY_ROOT", "RankGroups", "memory_cgroup_of", "oom_kills_of", "unavailable_reason"]

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
_COUNTER = itertools.count()


def memory_cgroup_of(proc_cgroup: str) -> str | None:
    """The memory controller's path in a ``/proc/<pid>/cgroup`` text (v1 ``N:memory:/path``), or ``None``."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            return parts[2]
    return None


def oom_kills_of(oom_control: str) -> int:
    """The ``oom_kill`` count of a ``memory.oom_control`` text (0 when the kernel does not report one)."""
    for line in oom_control.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def _own_group(root: Path = MEMORY_ROOT) -> Path | None:
    path = memory_cgroup_of(Path("/proc/self/cgroup").read_text())
    return None if path is None else root / path.lstrip("/")


def unavailable_reason(root: Path = MEMORY_ROOT) -> str | None:
    """Why per-process caps cannot be set here (``None``: they can)."""
    if os.geteuid() != 0:
        return "a memory cgroup needs root (run as root)"
    own = _own_group(root)
    if own is None or not (own / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {root} for this process"
    return None


class RankGroups:
    """One launch's cgroups: ``<own>/ds-bench-memory-<pid>-<n>/rank<r>``, each limited to ``cap_bytes``.

    Use it as a context manager: the groups are removed on the way out (after the ranks are gone).
    """

    def __init__(self, ranks: int, cap_bytes: int, root: Path = MEMORY_ROOT) -> None:
        own = _own_group(root)
        if own is None:
            raise RuntimeError(unavailable_reason(root) or "no memory cgroup")
        self.parent = own / f"ds-bench-memory-{os.getpid()}-{next(_COUNTER)}"
        self.groups = [self.parent / f"rank{r}" for r in range(ranks)]
        self.cap_bytes = cap_bytes

    def __enter__(self) -> RankGroups:
        self.parent.mkdir()
        for group in self.groups:
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(self.cap_bytes))
        return self

    def __exit__(self, *exc: object) -> None:
        for group in [*self.groups, self.parent]:
            with contextlib.suppress(OSError):
                group.rmdir()

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s group from its first instruction."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.groups[rank] / "cgroup.procs"), *argv]

    def oom_kills(self) -> list[int]:
        """Per rank, how many of its processes the OOM killer has killed."""
        return [oom_kills_of((g / "memory.oom_control").read_text()) for g in self.groups]

    def peaks(self) -> list[int]:
        """Per rank, the group's peak charge in bytes (``memory.max_usage_in_bytes``; page cache included)."""
        return [int((g / "memory.max_usage_in_bytes").read_text()) for g in self.groups]
