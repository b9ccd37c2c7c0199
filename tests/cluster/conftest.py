"""Fixtures for tests that need a multi-host network-namespace cluster.

Where a cluster can't be built the tests skip with the reason, except in CI running as root: there the machine is
meant to run them, so a missing requirement fails the test instead of letting CI pass with none of them run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import pytest

from ds_lightning.testing.netns import Cluster, missing_requirements

IPROUTE2 = ("ip", "tc", "ss")
# Where iproute2 lives when a non-login PATH lacks the sbin folders.
SYSTEM_DIRS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
_FALSE = ("", "0", "false", "no")


def default_search_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), *SYSTEM_DIRS])


def cluster_unavailable(search_path: str | None = None, euid: int | None = None) -> str | None:
    """Why no cluster can be built here (``None``: one can), checking root and iproute2 before probing netns rights.

    Args:
        search_path: folders to look for iproute2 in; the default is ``PATH`` plus the system folders.
        euid: the effective user id; the default is this process's.

    """
    if (os.geteuid() if euid is None else euid) != 0:
        return "needs root (uid 0) to create network namespaces"
    path = default_search_path() if search_path is None else search_path
    missing = [tool for tool in IPROUTE2 if shutil.which(tool, path=path) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2"
    return missing_requirements()


def unavailable_action(reason: str | None, environ: Mapping[str, str], euid: int) -> Literal["run", "skip", "fail"]:
    """What a cluster test does given :func:`cluster_unavailable`'s reason: run, skip, or (CI as root) fail."""
    if reason is None:
        return "run"
    in_ci = environ.get("CI", "").strip().lower() not in _FALSE
    return "fail" if in_ci and euid == 0 else "skip"


def require_cluster() -> None:
    """Skip (or, in CI as root, fail) the calling test when no cluster can be built here, naming the reason."""
    reason = cluster_unavailable()
    action = unavailable_action(reason, os.environ, os.geteuid())
    if action == "fail":
        pytest.fail(f"CI runs as root, so every cluster test must run, but this one cannot: {reason}", pytrace=False)
    if action == "skip":
        pytest.skip(reason)


@pytest.fixture
def netns_required() -> None:
    """Skips the test when network-namespace clusters can't be built here (not root, no iproute2, no netns)."""
    require_cluster()


@pytest.fixture
def cluster_factory(netns_required: None) -> Iterator[Callable[[int], Cluster]]:
    """Yields ``make(n_hosts) -> Cluster`` (already entered); every cluster made is closed at teardown."""
    made: list[Cluster] = []

    def make(n_hosts: int) -> Cluster:
        cluster = Cluster(n_hosts)
        made.append(cluster)  # before entering: a half-built cluster is torn down too
        return cluster.__enter__()

    try:
        yield make
    finally:
        for cluster in reversed(made):
            cluster.close()
