"""Fixtures for tests that need a multi-host network-namespace cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from ds_lightning.testing.netns import Cluster, missing_requirements


@pytest.fixture
def netns_required() -> None:
    """Skips the test when network-namespace clusters can't be built here (not root, no iproute2, no netns)."""
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)


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
