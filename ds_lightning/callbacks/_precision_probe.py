"""How ``MixedPrecision("auto")`` decides: it times the user's own training step in each precision, and the ranks agree.

On the first training batch of ``fit`` every rank runs the model's ``training_step`` and a backward pass on that batch,
in each candidate precision in turn: ``fp32``, ``bf16`` (autocast) and, on CUDA, ``fp16`` (autocast, the loss scaled
by a ``GradScaler`` and the gradients unscaled). One warm-up round, then ``passes`` timed rounds, the candidates
rotated each round so that drift in the machine's load hits all of them alike. One ``MAX`` all-reduce of the
``[candidate, round]`` seconds gives every rank the slowest rank's figures (synchronous training waits for it), and
:func:`decide` turns those identical figures into the same choice on every rank.

The rule (:func:`decide`): a candidate replaces fp32 only when its median is below fp32's by more than the margin, the
larger of :data:`MIN_MARGIN` (5%) and the noise, where the noise of a candidate is the interquartile range of its timed
rounds over their median, and the margin takes the noisier of the two. Among the candidates that clear it, the fastest
median wins.

The passes leave no trace: :func:`preserved` puts back the gradients, the module's buffers (e.g. BatchNorm's running
statistics) and the random streams (torch's CPU and CUDA generators, Python's, NumPy's), and :func:`logging_muted`
keeps ``self.log`` calls in ``training_step`` out of the logged metrics. The batch is the one Lightning already drew,
so the data order does not change, and no optimizer steps. What it cannot undo is a ``training_step``'s own side
effects beyond those (a torchmetrics metric it updates, a counter it keeps).
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "MIN_MARGIN",
    "Chosen",
    "PrecisionDecision",
    "agree",
    "candidates_for",
    "decide",
    "logging_muted",
    "preserved",
    "ruled_out_on_error",
    "time_candidates",
]

Chosen = Literal["bf16", "fp16", "fp32"]
BASELINE: Chosen = "fp32"
#: the smallest lead over fp32 (a fraction of fp32's median) that makes ``auto`` leave fp32, even on quiet figures
MIN_MARGIN = 0.05
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: runs one forward and backward pass of the training step in the named precision
RunPass = Callable[[str], None]
#: times the candidates on this rank: ``(run_pass, candidates, passes, device) -> {candidate: [seconds per round]}``
TimeCandidates = Callable[[RunPass, Sequence[str], int, torch.device], dict[str, list[float]]]


class _CandidateFailed(RuntimeError):
    """A timing pass in a low precision raised (an op without a kernel for that dtype): that precision cannot win.

    Private: :func:`time_candidates` catches it, so it never reaches a user.
    """


@contextlib.contextmanager
def ruled_out_on_error(candidate: str) -> Iterator[None]:
    """Turns a ``RuntimeError`` in ``candidate``'s timing pass into that candidate's exclusion from the timing."""
    try:
        yield
    except RuntimeError as exc:
        raise _CandidateFailed(f"{candidate}: {exc}") from exc


def candidates_for(device: torch.device) -> tuple[Chosen, ...]:
    """The precisions ``auto`` times on ``device``: fp32 and bf16 on a CPU, fp16 too on CUDA; fp32 elsewhere."""
    if device.type == "cpu":
        return ("fp32", "bf16")
    if device.type == "cuda":
        with torch.cuda.device(device):
            return ("fp32", "bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp32", "fp16")
    return (BASELINE,)


def time_candidates(
    run_pass: RunPass, candidates: Sequence[str], passes: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds of each of ``passes`` timed rounds per candidate, after one warm-up round (left out).

    Each round runs every candidate once, starting one candidate later than the round before. A candidate whose pass
    fails inside :func:`ruled_out_on_error` is not run again, and all its rounds read ``inf``.
    """

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # kernels return before the work is done

    seconds: dict[str, list[float]] = {c: [] for c in candidates}
    failed: set[str] = set()
    for round_ in range(passes + 1):
        k = round_ % len(candidates)
        for candidate in [c for c in [*candidates[k:], *candidates[:k]] if c not in failed]:
            sync()
            start = time.perf_counter()
            try:
                run_pass(candidate)
            except _CandidateFailed:
                failed.add(candidate)
                continue
            sync()
            if round_:  # round 0 warms up: allocation and kernel selection stay out of the figures
                seconds[candidate].append(time.perf_counter() - start)
    return {c: [math.inf] * passes if c in failed else xs for c, xs in seconds.items()}


def agree(
    seconds: Mapping[str, Sequence[float]],
    candidates: Sequence[str],
    device: torch.device,
    timeout: timedelta | None,
) -> dict[str, list[float]]:
    """Every rank's figures replaced by the slowest rank's, round by round: one ``MAX`` all-reduce.

    A collective on the default process group when it is initialised with more than one rank: every rank calls it
    with the same candidates and rounds. ``timeout`` bounds the wait (``None``: the group's own).
    """
    table = torch.tensor([list(seconds[c]) for c in candidates], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        work = dist.all_reduce(table, op=dist.ReduceOp.MAX, async_op=True)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timeout)
    return {c: row for c, row in zip(candidates, table.tolist(), strict=True)}


def _noise(xs: Sequence[float]) -> float:
    """Interquartile range over the median: how far the rounds of one candidate spread."""
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(xs)


@dataclass(frozen=True)
class PrecisionDecision:
    """What ``auto`` chose and the figures it chose on (identical on every rank).

    Attributes:
        chosen: the precision to train in.
        median_ms: each candidate's median milliseconds per forward and backward pass (the slowest rank's).
        noise: each candidate's interquartile range over its median.
        margin: each challenger's margin over fp32 (the larger of :data:`MIN_MARGIN` and the two noises).
        reason: one sentence for the log.

    """

    chosen: Chosen
    median_ms: dict[str, float] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)
    margin: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for the checkpoint and the benchmark's JSON."""
        return {
            "chosen": self.chosen,
            "median_ms": dict(self.median_ms),
            "noise": dict(self.noise),
            "margin": dict(self.margin),
            "reason": self.reason,
        }


def decide(seconds: Mapping[str, Sequence[float]], min_margin: float = MIN_MARGIN) -> PrecisionDecision:
    """fp32, unless a candidate's median beats fp32's by more than the margin; then the fastest such candidate.

    Args:
        seconds: timed rounds per candidate, fp32 among them (the agreed figures of :func:`agree`).
        min_margin: the smallest lead that counts, as a fraction of fp32's median.

    Raises:
        ValueError: without fp32 figures, or with a candidate that has none.

    """
    if BASELINE not in seconds or any(not xs for xs in seconds.values()) or not math.isfinite(max(seconds[BASELINE])):
        raise ValueError(f"decide() needs timed rounds of fp32 and of every candidate; got {dict(seconds)}.")
    median = {c: statistics.median(xs) for c, xs in seconds.items()}
    ran = [c for c in seconds if math.isfinite(median[c])]  # a candidate that failed on any rank reads inf
    noise = {c: _noise(seconds[c]) for c in ran}
    base = median[BASELINE]
    margin = {c: max(min_margin, noise[BASELINE], noise[c]) for c in ran if c != BASELINE}
    winners = [c for c in margin if median[c] < base * (1 - margin[c])]
    chosen = cast(Chosen, min(winners, key=median.__getitem__)) if winners else BASELINE  # seconds' keys are Chosen
    figures = ", ".join(
        f"{c} {1e3 * median[c]:.2f} ms (noise {noise[c]:.0%})" if c in noise else f"{c} could not run" for c in seconds
    )
    if chosen == BASELINE:
        reason = f"no precision beat fp32 by more than its margin ({figures})"
    else:
        lead = 1 - median[chosen] / base
        reason = f"{chosen} was {lead:.0%} faster than fp32, above its {margin[chosen]:.0%} margin ({figures})"
    return PrecisionDecision(
        chosen=chosen,
        median_ms={c: 1e3 * m for c, m in median.items()},
        noise=noise,
        margin=margin,
        reason=reason,
    )


@contextlib.contextmanager
def preserved(module: nn.Module, devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """Put back, on exit, the gradients, buffers and random streams that the timing passes change.

    A gradient that existed is copied back into the same tensor (a DDP gradient may be a view of its bucket); one that
    did not is set to ``None`` again.
    """
    grads = [(p, p.grad, p.grad.detach().clone() if p.grad is not None else None) for p in module.parameters()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    python_state = random.getstate()
    numpy_state = _numpy_state()
    cuda = [d for d in devices if d.type == "cuda"]
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        try:
            yield
        finally:
            with torch.no_grad():
                for param, grad, saved in grads:
                    if grad is None or saved is None:
                        param.grad = None
                    else:
                        grad.copy_(saved)
                        param.grad = grad
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            random.setstate(python_state)
            _set_numpy_state(numpy_state)


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


def _set_numpy_state(state: Any) -> None:
    if state is not None:
        import numpy

        numpy.random.set_state(state)


@contextlib.contextmanager
def logging_muted(module: Any) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing inside: a timing pass must not log a metric."""

    def mute(*args: Any, **kwargs: Any) -> None:
        return None

    module.log, module.log_dict = mute, mute
    try:
        yield
    finally:
        del module.log, module.log_dict  # the class's methods again
