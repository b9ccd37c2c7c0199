"""Per-rank summaries of step times and payload, the straggler verdict, and the report's table, JSON, PNG and trace.

The verdict (:func:`verdict`) compares what each rank needs for itself with what it waits for:

* A rank's **busy** time is its step less its communication wait: data loading, compute and optimizer. In
  synchronous training every rank's step ends up as long as the slowest one's, so step time alone cannot tell ranks
  apart; busy time can, because the fast ranks spend the difference waiting in the gradient all-reduce.
* **Compute-bound straggler**: the rank with the largest median busy time, when it exceeds the median of the other
  ranks' by more than the tolerance (``tolerance`` times the median step, and at least 0.5 ms). The reason names the
  phase that carries the excess (data loading, compute or optimizer).
* **Link-bound**: no rank's own work stands out, but the transfer takes more than a quarter of the step. The
  transfer time of a step is the shortest communication wait of any rank in it (:func:`transfer_ms`): the last rank
  to arrive waits for no one, so what it waits is the transfer itself, while the others' waits also hold the
  scheduling jitter between ranks. The straggler is the rank whose wait exceeds the others' by more than the
  tolerance; when every rank waits alike none is named, since a slow link slows every rank of a ring all-reduce.
* Otherwise the run is **balanced**.

Medians over steps (after the warm-up steps) keep a single slow step, a garbage collection or a checkpoint, from
deciding the verdict.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ds_lightning.diagnostics.link_verdict import LinkFinding
from ds_lightning.diagnostics.step_times import PHASES, StepTime
from ds_lightning.pipeline.trace import Span

__all__ = [
    "RankSummary",
    "Verdict",
    "format_table",
    "phase_spans",
    "render_steps_png",
    "report_dict",
    "transfer_ms",
    "verdict",
]

_NOISE_MS = 0.5
_LINK_SHARE = 0.25


@dataclass(frozen=True)
class RankSummary:
    """One rank's median milliseconds per step in each phase, and its collective payload.

    Attributes:
        rank: global rank.
        steps: steps measured (after the warm-up).
        data_ms: median data loading per step.
        compute_ms: median compute (forward and backward) per step.
        comm_ms: median wait on communication per step.
        optimizer_ms: median optimizer step.
        step_ms: median whole step.
        busy_ms: median step less its communication wait.
        payload_sent: payload bytes handed to collectives during training (``None`` if not recorded).
        payload_received: payload bytes written back by collectives.
        collectives: collective and point-to-point operations counted.
        lost_records: Flight Recorder entries overwritten before they were counted.
        wire_sent: bytes this rank's TCP connections to the other ranks sent, the kernel's count (``None``: none
            found, :mod:`~ds_lightning.diagnostics.link_counters`).
        wire_received: bytes they received.

    """

    rank: int
    steps: int
    data_ms: float
    compute_ms: float
    comm_ms: float
    optimizer_ms: float
    step_ms: float
    busy_ms: float
    payload_sent: int | None = None
    payload_received: int | None = None
    collectives: int = 0
    lost_records: int = 0
    wire_sent: int | None = None
    wire_received: int | None = None

    @classmethod
    def of(cls, rank: int, steps: Sequence[StepTime], **payload: Any) -> RankSummary:
        """Summarise ``steps`` of ``rank`` (medians in milliseconds); ``payload`` fills the byte fields."""

        def median_ms(values: list[int]) -> float:
            return statistics.median(values) / 1e6 if values else 0.0

        return cls(
            rank=rank,
            steps=len(steps),
            data_ms=median_ms([s.data_ns for s in steps]),
            compute_ms=median_ms([s.compute_ns for s in steps]),
            comm_ms=median_ms([s.comm_ns for s in steps]),
            optimizer_ms=median_ms([s.optimizer_ns for s in steps]),
            step_ms=median_ms([s.total_ns for s in steps]),
            busy_ms=median_ms([s.busy_ns for s in steps]),
            **payload,
        )

    def phase_ms(self, phase: str) -> float:
        """The median of one of :data:`~ds_lightning.diagnostics.step_times.PHASES`."""
        return float(getattr(self, f"{phase}_ms"))


@dataclass(frozen=True)
class Verdict:
    """Who holds the run back, and why.

    Attributes:
        straggler: the rank named, or ``None``.
        bound: ``"compute-bound"``, ``"link-bound"`` or ``"balanced"``.
        reason: one sentence with the figures behind it.

    """

    straggler: int | None
    bound: str
    reason: str


def _median_except(values: dict[int, float], rank: int) -> float:
    return statistics.median(v for r, v in values.items() if r != rank)


def transfer_ms(steps: Mapping[int, Sequence[StepTime]]) -> float:
    """The median over steps of the shortest communication wait of any rank in that step, in ms.

    The last rank to reach a step's all-reduce waits for no one, only for the transfer itself; the others also wait
    for it. So the shortest wait of a step is its transfer time, and what scheduling jitter adds to the others' waits
    is left out. Steps are matched by their index; a step some rank did not measure is skipped.
    """
    if not steps:
        return 0.0
    by_step: dict[int, list[int]] = {}
    for rank_steps in steps.values():
        for s in rank_steps:
            by_step.setdefault(s.step, []).append(s.comm_ns)
    shortest = [min(waits) for waits in by_step.values() if len(waits) == len(steps)]
    return statistics.median(shortest) / 1e6 if shortest else 0.0


def verdict(summaries: Sequence[RankSummary], tolerance: float = 0.1, transfer: float | None = None) -> Verdict:
    """Name the straggler and say whether it is compute-bound or link-bound (rule in the module doc).

    Args:
        summaries: one per rank.
        tolerance: share of the median step below which differences count as noise.
        transfer: the transfer time per step in ms (:func:`transfer_ms`); ``None`` takes the smallest rank's median
            communication wait.

    Returns:
        The :class:`Verdict`.

    """
    measured = [s for s in summaries if s.steps]
    if len(measured) < 2:
        return Verdict(None, "balanced", "one rank measured: there is no other rank to wait for")
    step = statistics.median(s.step_ms for s in measured)
    floor = max(tolerance * step, _NOISE_MS)
    busy = {s.rank: s.busy_ms for s in measured}
    by_rank = {s.rank: s for s in measured}
    slowest = max(busy, key=lambda r: busy[r])
    excess = busy[slowest] - _median_except(busy, slowest)
    if excess > floor:
        others = {p: _median_except({r: s.phase_ms(p) for r, s in by_rank.items()}, slowest) for p in PHASES}
        gaps = {p: by_rank[slowest].phase_ms(p) - others[p] for p in ("data", "compute", "optimizer")}
        phase = max(gaps, key=lambda p: gaps[p])
        what = {"data": "data loading", "compute": "compute", "optimizer": "the optimizer step"}[phase]
        return Verdict(
            slowest,
            "compute-bound",
            f"rank {slowest} needs {busy[slowest]:.2f} ms a step for its own work against"
            f" {busy[slowest] - excess:.2f} ms on the others (mostly {what}: +{gaps[phase]:.2f} ms), and the others"
            f" wait {others['comm']:.2f} ms a step in communication for it",
        )
    comm = {s.rank: s.comm_ms for s in measured}
    waiting = max(comm, key=lambda r: comm[r])
    transfer = min(comm.values()) if transfer is None else transfer
    if transfer > max(_LINK_SHARE * step, floor):
        share = transfer / step if step else 0.0
        if comm[waiting] - _median_except(comm, waiting) > floor:
            return Verdict(
                waiting,
                "link-bound",
                f"every rank's own work is within {floor:.2f} ms of the others', the transfer takes {transfer:.2f} ms"
                f" a step ({share:.0%}), and rank {waiting} waits {comm[waiting]:.2f} ms a step in communication"
                f" against {_median_except(comm, waiting):.2f} ms on the others",
            )
        return Verdict(
            None,
            "link-bound",
            f"every rank's own work is within {floor:.2f} ms of the others', and the transfer takes"
            f" {transfer:.2f} ms a step ({share:.0%}) even for the last rank to arrive: the links (or the"
            " collective's algorithm) set the pace, not one rank",
        )
    return Verdict(
        None,
        "balanced",
        f"every rank's own work is within {floor:.2f} ms of the others' and the transfer takes {transfer:.2f} ms of"
        f" a {step:.2f} ms step",
    )


def _megabytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def format_table(
    summaries: Sequence[RankSummary],
    found: Verdict,
    warmup_steps: int,
    transfer: float | None = None,
    links: LinkFinding | None = None,
) -> str:
    """A short text table: one row per rank, the transfer time, the verdict, and the links between hosts.

    The transfer time is :func:`transfer_ms`; each host's link (:func:`~ds_lightning.diagnostics.link_verdict.
    find_slow_link`) is listed when the ranks are on several hosts.
    """
    steps = max((s.steps for s in summaries), default=0)
    lines = [
        f"DistributedReport: median ms a step over {steps} steps a rank (after {warmup_steps} warm-up);"
        " payload (what collectives were handed) and wire (the kernel's TCP count) in MB",
        f"{'rank':>4} {'data':>8} {'compute':>8} {'comm':>8} {'optim':>8} {'step':>8} {'sent':>9} {'received':>9}"
        f" {'wire out':>9} {'wire in':>9}",
    ]
    for s in summaries:
        lines.append(
            f"{s.rank:>4} {s.data_ms:>8.2f} {s.compute_ms:>8.2f} {s.comm_ms:>8.2f} {s.optimizer_ms:>8.2f}"
            f" {s.step_ms:>8.2f} {_megabytes(s.payload_sent):>9} {_megabytes(s.payload_received):>9}"
            f" {_megabytes(s.wire_sent):>9} {_megabytes(s.wire_received):>9}"
        )
    if transfer is not None and len(summaries) > 1:
        lines.append(f"transfer: {transfer:.2f} ms a step (the shortest communication wait of any rank, median)")
    named = f"rank {found.straggler} is the straggler, {found.bound}" if found.straggler is not None else found.bound
    lines.append(f"verdict: {named}: {found.reason}.")
    if links is not None and len(links.hosts) > 1:
        for h in links.hosts:
            rate = "-" if h.rate_mb_s is None else f"{h.rate_mb_s:.1f} MB/s"
            lines.append(
                f"  host {h.host} (ranks {list(h.ranks)}): fastest transfer {rate}, busy {h.link_ms:.2f} ms a step,"
                f" {h.sent / 1e6:.2f} MB out and {h.received / 1e6:.2f} MB in to other hosts"
            )
        lines.append(f"links: {links.reason}.")
    return "\n".join(lines)


def report_dict(
    summaries: Sequence[RankSummary],
    found: Verdict,
    steps: Mapping[int, Sequence[StepTime]],
    meta: dict[str, Any],
    links: LinkFinding | None = None,
) -> dict[str, Any]:
    """The JSON document: ``meta``, the verdict, the links, per-rank summaries, every measured step of every rank."""
    return {
        "version": 1,
        **meta,
        "verdict": asdict(found),
        "links": None if links is None else asdict(links),
        "ranks": [asdict(s) for s in summaries],
        "step_columns": ["step", *[f"{p}_ms" for p in PHASES]],
        "steps": {
            str(rank): [[s.step, *[round(s.phase_ns(p) / 1e6, 4) for p in PHASES]] for s in rank_steps]
            for rank, rank_steps in sorted(steps.items())
        },
    }


def phase_spans(rank: int, steps: Sequence[StepTime]) -> list[Span]:
    """Spans for the pipeline's trace export, in the order they happened.

    The wait in collectives before the batch (as comm), data loading up to the batch start, then compute, the rest of
    comm, and the optimizer.
    """
    spans = []
    for s in steps:
        at = s.start_ns - s.data_ns - s.sync_ns
        lengths = [("comm", s.sync_ns), ("data", s.data_ns), ("compute", s.compute_ns)]
        lengths += [("comm", s.comm_ns - s.sync_ns), ("optimizer", s.optimizer_ns)]
        for phase, length in lengths:
            if length > 0:
                spans.append(Span(rank, 0, phase, 0, s.step, at, at + length))
            at += length
    return spans


def render_steps_png(steps: Mapping[int, Sequence[StepTime]], path: str | Path, title: str) -> Path:
    """Plot per-rank step time and busy time (step less communication wait) over steps, and write a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 5.5))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for rank, rank_steps in sorted(steps.items()):
        xs = [s.step for s in rank_steps]
        top.plot(xs, [s.total_ns / 1e6 for s in rank_steps], linewidth=1, label=f"rank {rank}")
        bottom.plot(xs, [s.busy_ns / 1e6 for s in rank_steps], linewidth=1, label=f"rank {rank}")
    top.set_ylabel("step (ms)")
    bottom.set_ylabel("own work (ms)\n= step - comm wait")
    bottom.set_xlabel("step")
    top.set_title(title, fontsize=10)
    top.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path
