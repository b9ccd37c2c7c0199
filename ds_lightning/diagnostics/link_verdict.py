"""Which host's link is the slow one, and how much of each step it holds, from every rank's TCP counters.

Every rank reports, per remote address, the bytes its connections sent and their busy time
(:mod:`ds_lightning.diagnostics.link_counters`). Grouping ranks by host gives, for each ordered pair of hosts
``a -> b``, the rate the transfers from ``a`` to ``b`` ran at: bytes over busy time. A transfer is at most as fast
as the slower of the two links it crosses, so:

* a host's **link rate** is the fastest rate of any transfer to or from it: its own link carried at least that;
* the **slow link** is the host whose link rate is under half the median of the other hosts'. Every transfer to or
  from that host is slow, while each other host has at least one fast transfer (with another fast host);
* with two hosts both ends see the one transfer between them, so a slow link cannot be placed on either of them.
  Three hosts or more can tell (the test runs three);
* a host's **link time** in a step is the longest busy time of any transfer to or from it in that step (transfers
  over one link run side by side, so the link was busy at least that long). The median over steps is what the
  report attributes to that host's communication.

Transfers too small to time (under 1 MB, or under 20 ms busy in all: the kernel counts busy time in jiffies) give
no rate.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["HostLink", "LinkFinding", "LinkUse", "RankLinks", "find_slow_link"]

_MIN_BYTES = 1_000_000
_MIN_BUSY_US = 20_000
_SLOW_RATIO = 0.5


@dataclass(frozen=True)
class LinkUse:
    """What one rank's connections to one remote address did: bytes, busy time, and busy time per step (µs)."""

    bytes_sent: int
    bytes_received: int
    busy_us: int
    step_busy_us: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RankLinks:
    """One rank's host address (``None``: no TCP links found) and its use of each remote address."""

    rank: int
    host: str | None
    links: Mapping[str, LinkUse]


@dataclass(frozen=True)
class HostLink:
    """One host's link, as the transfers over it saw it.

    Attributes:
        host: the host's address.
        ranks: the ranks on it.
        rate_mb_s: the fastest rate of a transfer to or from it, in MB/s (``None``: none large enough to time).
        link_ms: the median over steps of its link time (the longest busy transfer over it in the step).
        sent: bytes its ranks sent to other hosts (the kernel's count).
        received: bytes its ranks received from other hosts.

    """

    host: str
    ranks: tuple[int, ...]
    rate_mb_s: float | None
    link_ms: float
    sent: int
    received: int


@dataclass(frozen=True)
class LinkFinding:
    """Every host's link, the slow one if any, and why."""

    hosts: tuple[HostLink, ...]
    slow_host: str | None
    reason: str

    def host(self, address: str) -> HostLink:
        """The :class:`HostLink` of ``address``."""
        return next(h for h in self.hosts if h.host == address)


def _pairs(ranks: Sequence[RankLinks], hosts: set[str]) -> dict[tuple[str, str], list[LinkUse]]:
    pairs: dict[tuple[str, str], list[LinkUse]] = {}
    for r in ranks:
        if r.host is None:
            continue
        for remote, use in r.links.items():
            if remote in hosts and remote != r.host:
                pairs.setdefault((r.host, remote), []).append(use)
    return pairs


def _rate(uses: Sequence[LinkUse]) -> float | None:
    sent, busy = sum(u.bytes_sent for u in uses), sum(u.busy_us for u in uses)
    return sent / busy if sent >= _MIN_BYTES and busy >= _MIN_BUSY_US else None


def _link_ms(uses: Sequence[LinkUse], steps: set[int]) -> float:
    if not steps:
        return 0.0
    longest = {s: max((u.step_busy_us.get(s, 0) for u in uses), default=0) for s in steps}
    return statistics.median(longest.values()) / 1e3


def find_slow_link(ranks: Sequence[RankLinks], step_ms: float) -> LinkFinding:
    """Every host's link rate and link time, and the slow host's link if there is one (rule in the module doc).

    Args:
        ranks: every rank's links.
        step_ms: the median step, for the share of it a link holds.

    """
    on_host: dict[str, list[int]] = {}
    for r in ranks:
        if r.host is not None:
            on_host.setdefault(r.host, []).append(r.rank)
    hosts = set(on_host)
    pairs = _pairs(ranks, hosts)
    steps = {s for uses in pairs.values() for u in uses for s in u.step_busy_us}
    rows = []
    for host in sorted(hosts):
        touching = [uses for (a, b), uses in pairs.items() if host in (a, b)]
        rates = [rate for rate in (_rate(uses) for uses in touching) if rate is not None]
        outgoing = [u for (a, _), uses in pairs.items() if a == host for u in uses]
        rows.append(
            HostLink(
                host=host,
                ranks=tuple(sorted(on_host[host])),
                rate_mb_s=max(rates) if rates else None,
                link_ms=_link_ms([u for uses in touching for u in uses], steps),
                sent=sum(u.bytes_sent for u in outgoing),
                received=sum(u.bytes_received for u in outgoing),
            )
        )
    found = tuple(rows)
    if len(hosts) < 2:
        return LinkFinding(found, None, "every rank is on one host: there is no link between hosts to compare")
    rated = {h.host: h.rate_mb_s for h in rows if h.rate_mb_s is not None}
    if len(rated) < 2:
        return LinkFinding(found, None, "the transfers between hosts were too small to time (under 1 MB or 20 ms)")
    if len(hosts) == 2:
        return LinkFinding(
            found,
            None,
            "with two hosts both ends see the one transfer between them, so a slow link cannot be placed on either"
            f" ({min(rated.values()):.1f} MB/s); three hosts or more can tell",
        )
    slowest = min(rated, key=lambda h: rated[h])
    others = statistics.median(rate for h, rate in rated.items() if h != slowest)
    if rated[slowest] >= _SLOW_RATIO * others:
        return LinkFinding(
            found,
            None,
            f"the links between hosts carried {min(rated.values()):.1f} to {max(rated.values()):.1f} MB/s:"
            " none is under half the others' rate",
        )
    slow = next(h for h in rows if h.host == slowest)
    share = slow.link_ms / step_ms if step_ms else 0.0
    return LinkFinding(
        found,
        slowest,
        f"host {slowest}'s link (ranks {list(slow.ranks)}) is the slow one: no transfer to or from it ran faster than"
        f" {rated[slowest]:.1f} MB/s against {others:.1f} MB/s on the other hosts' links, and it was busy"
        f" {slow.link_ms:.2f} ms a step ({share:.0%} of the {step_ms:.2f} ms step)",
    )
