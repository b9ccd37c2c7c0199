"""The cost model of ``gradient_compression="auto"``: predicted step time per candidate, and the choice.

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

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AUTO_CANDIDATES", "AllReduceFit", "Choice", "LinkFigures", "Workload", "choose", "powersgd_numel"]

AUTO_CANDIDATES: tuple[str, ...] = ("none", "fp16", "powersgd")


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
        compress_s: compute per step of each compression, in seconds (``{"fp16": ..., "powersgd": ...}``).

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
            compress_s={str(k): float(v) for k, v in data["compress_s"].items()},
        )


@dataclass(frozen=True)
class Workload:
    """What one step sends.

    Attributes:
        gradient_bytes: bytes of one uncompressed gradient all-reduce (float32).
        powersgd_bytes: bytes PowerSGD sends per step at the user's rank.
        buckets: DDP buckets per step (one all-reduce each; PowerSGD issues two).

    """

    gradient_bytes: int
    powersgd_bytes: int
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


def powersgd_numel(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float) -> int:
    """Numbers PowerSGD sends per step for parameters of ``shapes`` (as :mod:`ds_lightning.comm.powersgd` sends)."""
    total = 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        if len(shape) < 2 or numel == 0:
            total += numel
            continue
        n, m = shape[0], numel // shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else numel
    return total


def comm_seconds(name: str, link: LinkFigures, work: Workload) -> float:
    """Predicted communication (and compression compute) time of one step under ``name``."""
    n = link.world_size
    if name == "none":
        return link.float32.seconds(work.gradient_bytes, n, work.buckets)
    if name == "fp16":
        return link.float16.seconds(work.gradient_bytes / 2, n, work.buckets) + link.compress_s.get("fp16", 0.0)
    if name == "powersgd":
        sent = link.float32.seconds(work.powersgd_bytes, n, 2 * work.buckets)
        return sent + link.compress_s.get("powersgd", 0.0)
    raise ValueError(f"no cost model for gradient_compression={name!r}; auto chooses among {AUTO_CANDIDATES}.")


def choose(
    link: LinkFigures,
    work: Workload,
    *,
    current: str,
    step_s: float | None,
    powersgd_allowed: bool,
    margin: float = 0.05,
) -> Choice:
    """The candidate with the lowest predicted step time, under two rules against noise.

    A compression is chosen only if it saves more than ``margin`` of ``none``'s predicted step time: compression costs
    accuracy, so it must earn that, and ``none`` returns as soon as no compression does (a link that got faster is
    followed at the next decision). Between two compressions, ``current`` stays unless the other saves ``margin``.

    Args:
        link: the probe's figures.
        work: what a step sends.
        current: the compression running now.
        step_s: the measured step time under ``current`` (``None`` before any step: compute is taken as 0).
        powersgd_allowed: whether PowerSGD's warm-up is over.
        margin: the fraction of the predicted step time a compression must save (see above).

    Returns:
        The choice, with every considered candidate's predicted step time.

    """
    candidates = [c for c in AUTO_CANDIDATES if c != "powersgd" or powersgd_allowed]
    comm = {c: comm_seconds(c, link, work) for c in AUTO_CANDIDATES}
    compute = max(step_s - comm[current], 0.0) if step_s is not None else 0.0
    predicted = {c: compute + comm[c] for c in candidates}
    best = min(candidates, key=lambda c: predicted[c])  # ties: the earlier (cheaper in accuracy) candidate
    if predicted["none"] - predicted[best] <= margin * predicted["none"]:
        best = "none"
    elif (
        current in candidates
        and current not in (best, "none")
        and predicted[current] - predicted[best] <= margin * predicted[current]
    ):
        best = current
    return Choice(best, predicted, compute)
