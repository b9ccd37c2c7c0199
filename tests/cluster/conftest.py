"""Fixtures for tests that need a multi-host network-namespace cluster.

Where a cluster can't be built the tests skip with the reason, except where ``DS_LIGHTNING_REQUIRE_CLUSTER=1`` says
this machine is meant to run them (``.ci/run`` exports it): there a missing requirement fails the test instead of
letting the suite pass with none of them run. A CI machine that cannot build clusters sets it to 0, in the open.
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
REQUIRE_CLUSTER = "DS_LIGHTNING_REQUIRE_CLUSTER"  # "1": a cluster test that cannot run fails instead of skipping


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


def unavailable_action(reason: str | None, environ: Mapping[str, str]) -> Literal["run", "skip", "fail"]:
    """What a cluster test does given :func:`cluster_unavailable`'s reason: run, skip, or (switch on) fail.

    Only the dedicated switch counts: a ``CI`` variable some runners set and others do not decides nothing.
    """
    if reason is None:
        return "run"
    return "fail" if environ.get(REQUIRE_CLUSTER, "").strip() == "1" else "skip"


def require_cluster() -> None:
    """Skip (or, with ``DS_LIGHTNING_REQUIRE_CLUSTER=1``, fail) the calling test when no cluster can be built here,
    naming the reason."""
    reason = cluster_unavailable()
    action = unavailable_action(reason, os.environ)
    if action == "fail":
        pytest.fail(
            f"{REQUIRE_CLUSTER}=1 (.ci/run) says every cluster test must run here, but this one cannot: {reason} "
            f"(set {REQUIRE_CLUSTER}=0 on a machine that cannot build namespace clusters)",
            pytrace=False,
        )
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
