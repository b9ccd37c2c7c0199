"""The cost model of ``gradient_compression="auto"``: predicted step time per candidate, and the choice.

The candidates are the registered compression methods marked ``auto_candidate``; each one predicts its own step's
communication (:meth:`~ds_lightning.comm.compression.base.Compression.comm_seconds`) from the figures below.

A ring all-reduce of ``B`` bytes over ``N`` ranks takes ``2(N-1)`` rounds, each paying the link's latency, and moves
``2(N-1)/N * B`` bytes through every rank's link:

    t(B) = 2(N-1) * latency + 2(N-1)/N * B / bandwidth

A step issues one all-reduce per DDP bucket (PowerSGD two: ``P`` then ``Q``), and compression adds its own compute
(the half-width cast, PowerSGD's matrix products and QR), measured on this model's shapes. The half-width path gets
its own bandwidth because gloo sums half-precision tensors on the CPU far slower than float32 ones: on loopback that
cost, not the link, decides. A step's compute (forward, backward, optimizer, data) is the measured step time minus
the predicted communication of the compression that ran.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_lightning.comm.compression.base import Compression

__all__ = ["AllReduceFit", "Choice", "LinkFigures", "Workload", "choose"]


@dataclass(frozen=True)
class AllReduceFit:
    """One all-reduce path: per-round latency and per-link bandwidth.

    Attributes:
        latency_s: seconds per ring round.
        bandwidth: bytes per second through one rank's link.

    """

    latency_s: float
    bandwidth: float

    def seconds(self, nbytes: float, world_size: int, collectives: float = 1.0) -> float:
        """Predicted time of ``collectives`` ring all-reduces carrying ``nbytes`` in total over ``world_size`` ranks."""
        if world_size < 2:
            return 0.0
        rounds = 2 * (world_size - 1)
        return collectives * rounds * self.latency_s + rounds / world_size * nbytes / self.bandwidth


@dataclass(frozen=True)
class LinkFigures:
    """What the probe measured, identical on every rank (each figure is the slowest rank's).

    Attributes:
        world_size: ranks that took part.
        float32: the float32 all-reduce path (``none`` and PowerSGD).
        float16: the half-width all-reduce path (``fp16``).
        compress_s: compute per step of each candidate that computes, in seconds (``{"fp16": ..., ...}``).

    """

    world_size: int
    float32: AllReduceFit
    float16: AllReduceFit
    compress_s: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers, for logs and checkpoints."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkFigures:
        """The inverse of :meth:`as_dict`."""
        return cls(
            world_size=int(data["world_size"]),
            float32=AllReduceFit(**data["float32"]),
            float16=AllReduceFit(**data["float16"]),
            compress_s={str(k): float(v) for k, v in data.get("compress_s", {}).items()},  # none: not saved
        )


@dataclass(frozen=True)
class Workload:
    """What one step sends.

    Attributes:
        gradient_bytes: bytes of one uncompressed gradient all-reduce (float32).
        sent_bytes: bytes each candidate sends per step (its bytes model, on this model's shapes).
        buckets: DDP buckets per step (one all-reduce each; PowerSGD issues two).

    """

    gradient_bytes: int
    sent_bytes: Mapping[str, float]
    buckets: int = 1


@dataclass(frozen=True)
class Choice:
    """One decision of the cost model.

    Attributes:
        name: the chosen compression.
        predicted_s: predicted step time per candidate considered, in seconds.
        compute_s: the step's compute the prediction assumed (0.0 before a step was timed).

    """

    name: str
    predicted_s: dict[str, float]
    compute_s: float


def choose(
    link: LinkFigures,
    work: Workload,
    *,
    current: str,
    step_s: float | None,
    candidates: Sequence[type[Compression] | Compression] | None = None,
    allowed: Collection[str] | None = None,
    margin: float = 0.05,
) -> Choice:
    """The candidate with the lowest predicted step time, under two rules against noise.

    A compression is chosen only if it saves more than ``margin`` of the lossless baseline's (``none``'s) predicted
    step time: compression costs accuracy, so it must earn that, and the baseline returns as soon as no compression
    does (a link that got faster is followed at the next decision). Between two compressions, ``current`` stays
    unless the other saves ``margin``.

    Args:
        link: the probe's figures.
        work: what a step sends.
        current: the compression running now.
        step_s: the measured step time under ``current`` (``None`` before any step: compute is taken as 0).
        candidates: the methods to choose among, the lossless baseline among them (default: the registry's).
        allowed: the names that may be chosen now (default: all; a method still in its warm-up is left out).
        margin: the fraction of the predicted step time a compression must save (see above).

    Returns:
        The choice, with every allowed candidate's predicted step time.

    """
    if candidates is None:
        from ds_lightning.comm.compression.registry import auto_candidates  # the registry imports the methods

        candidates = auto_candidates()
    baseline = next(c.name for c in candidates if c.lossless)
    names = [c.name for c in candidates if allowed is None or c.name in allowed or c.lossless]
    comm = {c.name: c.comm_seconds(link, work) for c in candidates}
    compute = max(step_s - comm[current], 0.0) if step_s is not None else 0.0
    predicted = {c: compute + comm[c] for c in names}
    best = min(names, key=lambda c: predicted[c])  # ties: the earlier (cheaper in accuracy) candidate
    if predicted[baseline] - predicted[best] <= margin * predicted[baseline]:
        best = baseline
    elif (
        current in names
        and current not in (best, baseline)
        and predicted[current] - predicted[best] <= margin * predicted[current]
    ):
        best = current
    return Choice(best, predicted, compute)
