"""The one DDP comm hook of ``gradient_compression="auto"``: it runs the current choice and re-decides on schedule.

DDP accepts one ``register_comm_hook`` per model (pytorch issue 102721), so the hook registered at set-up stays and
dispatches each bucket to the hook of the current choice (``none``, ``fp16`` or ``powersgd``). At the first bucket of
a step the hook may re-decide: every ``interval`` gradient synchronisations it re-probes the link, and at the step
PowerSGD's warm-up ends it re-decides on the last figures. Rank 0 decides and broadcasts its choice, so every rank
runs the same collectives even when the ranks' step times differ. Collectives are issued from the hook's thread at
the first bucket of a step, before any of that step's all-reduces: every rank issues them in the same order.

Switching into PowerSGD clears its error feedback: the memory holds the residual of gradients from the last time
PowerSGD ran, possibly hundreds of steps and a different model ago, and adding that stale residual to today's
gradient would apply an old update a second time. The warm-start ``Q`` memory stays (it only speeds the power step).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ds_lightning.comm.auto.model import AUTO_CANDIDATES, Choice, LinkFigures, Workload, choose
from ds_lightning.comm.auto.probe import PROBE_BYTES, compression_compute, probe_link
from ds_lightning.comm.powersgd import PowerSGDState
from ds_lightning.comm.wire import WireLog

log = logging.getLogger(__name__)

__all__ = ["AutoDecision", "AutoState", "auto_hook"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class AutoDecision:
    """One decision, as logged.

    Attributes:
        step: gradient synchronisations before the decision.
        choice: the compression chosen.
        previous: the compression that ran before.
        probed: whether the link was re-probed for it.
        figures: the link figures it rested on.
        predicted_s: predicted step time per candidate.
        step_s: the measured step time it used (``None`` before any step).

    """

    step: int
    choice: str
    previous: str
    probed: bool
    figures: LinkFigures
    predicted_s: dict[str, float]
    step_s: float | None

    def message(self, rank: int) -> str:
        """The log line."""
        f = self.figures
        predicted = ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in self.predicted_s.items())
        step = f"{self.step_s * 1e3:.2f} ms" if self.step_s is not None else "not yet timed"
        return (
            f"ds_mirrored auto compression at step {self.step}: {self.choice} (was {self.previous};"
            f" {'probed' if self.probed else 'last figures'}). Link over {f.world_size} ranks: latency"
            f" {f.float32.latency_s * 1e6:.1f} us/round, bandwidth {f.float32.bandwidth / 1e6:.1f} MB/s (float32),"
            f" {f.float16.bandwidth / 1e6:.1f} MB/s (float16); compression compute"
            f" fp16 {f.compress_s.get('fp16', 0.0) * 1e3:.3f} ms, powersgd rank {rank}"
            f" {f.compress_s.get('powersgd', 0.0) * 1e3:.3f} ms; step {step}; predicted ms/step: {predicted}."
        )


@dataclass
class AutoState:
    """State of :func:`auto_hook` on one rank.

    Attributes:
        process_group: the group gradients are all-reduced over (``None``: the default group).
        device: where gradients live.
        hooks: ``(state, hook)`` per candidate name, all logging into one wire log.
        powersgd: PowerSGD's state (its own warm-up off: this state enforces ``start_iter``).
        workload: what a step sends (``buckets`` is updated from the buckets DDP really hands over).
        compute_matrices: ``(n, m, r)`` per matrix PowerSGD compresses, for timing its compute.
        interval: gradient synchronisations between probes.
        start_iter: PowerSGD is not chosen before this many synchronisations.
        choice: the compression running now.
        step: gradient synchronisations so far.
        figures: the last probe's figures.
        override: figures to decide on instead of probing (test and what-if use); only rank 0's matter.
        decisions: the latest decisions, oldest first.
        probe_sizes: all-reduce sizes of a probe, in bytes.

    """

    process_group: dist.ProcessGroup | None
    device: torch.device
    hooks: dict[str, tuple[Any, Hook]]
    powersgd: PowerSGDState
    workload: Workload
    compute_matrices: list[tuple[int, int, int]]
    interval: int = 500
    start_iter: int = 10
    choice: str = "none"
    step: int = 0
    figures: LinkFigures | None = None
    override: LinkFigures | None = None
    decisions: deque[AutoDecision] = field(default_factory=lambda: deque(maxlen=64))
    probe_sizes: tuple[int, ...] = PROBE_BYTES
    _compress_s: dict[str, float] | None = None
    _step_started: float | None = None
    _in_step: bool = False
    _buckets_open: int = 0
    _probed_this_step: bool = False
    _step_times: deque[float] = field(default_factory=lambda: deque(maxlen=32))

    @property
    def wire(self) -> WireLog:
        """What every choice's collectives sent (one log, shared by the candidates' hooks)."""
        return self.powersgd.wire

    def probe(self) -> LinkFigures:
        """Measure the link (a collective: every rank calls it at the same point)."""
        if self._compress_s is None:
            self._compress_s = compression_compute(
                self.workload.gradient_bytes // 4, self.compute_matrices, self.device
            )
        self.figures = probe_link(self.process_group, self.device, self._compress_s, self.probe_sizes)
        return self.figures

    def decide(self, probe: bool) -> AutoDecision:
        """Re-decide on rank 0 (after probing, if ``probe``) and broadcast the choice (a collective)."""
        if probe or self.figures is None:
            self.probe()
            probe = True
        figures = self.override if self.override is not None else self.figures
        assert figures is not None
        step_s = statistics.median(self._step_times) if self._step_times else None
        made: Choice = choose(
            figures, self.workload, current=self.choice, step_s=step_s, powersgd_allowed=self.step >= self.start_iter
        )
        chosen = torch.tensor([AUTO_CANDIDATES.index(made.name)], dtype=torch.int64, device=self.device)
        source = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        dist.broadcast(chosen, src=source, group=self.process_group)
        name = AUTO_CANDIDATES[int(chosen.item())]
        decision = AutoDecision(self.step, name, self.choice, probe, figures, made.predicted_s, step_s)
        self.decisions.append(decision)
        if name == "powersgd" and self.choice != "powersgd":
            self.powersgd.error.clear()  # stale error feedback would re-apply an old update (module docstring)
        if name != self.choice:
            self._step_times.clear()  # step times of the old choice no longer describe the new one
        self.choice = name
        if dist.get_rank() == 0:
            rank_zero_info(decision.message(self.powersgd.rank))
            log.debug("auto compression figures: %s", figures.as_dict())
        return decision

    def _begin_step(self) -> None:
        now = time.perf_counter()
        if self._step_started is not None and not self._probed_this_step:
            self._step_times.append(now - self._step_started)
        self._probed_this_step = False
        due_probe = self.step > 0 and self.step % self.interval == 0
        warmup_over = self.step == self.start_iter and self.step > 0 and self.choice != "powersgd"
        if due_probe or warmup_over:
            self.decide(probe=due_probe)
            self._probed_this_step = due_probe
        self._step_started = time.perf_counter() if self._probed_this_step else now

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers and tensors: the choice, the step count, the last figures and PowerSGD's memory."""
        return {
            "choice": self.choice,
            "step": self.step,
            "figures": self.figures.as_dict() if self.figures is not None else None,
            "powersgd": self.powersgd.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict`'s output; probes then fall on the same steps as in the saved run."""
        self.choice = str(state["choice"])
        self.step = int(state["step"])
        self.figures = LinkFigures.from_dict(state["figures"]) if state.get("figures") is not None else self.figures
        self.powersgd.load_state_dict(state["powersgd"], device=device)
        self._step_times.clear()
        self._step_started = None


def auto_hook(state: AutoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: run the current choice's hook; re-decide at the first bucket of a step when due."""
    if not state._in_step:
        state._in_step = True
        state._buckets_open = 0
        state._begin_step()
    state._buckets_open += 1
    hook_state, hook = state.hooks[state.choice]
    future = hook(hook_state, bucket)
    if bucket.is_last():
        state._in_step = False
        state.step += 1
        if state._buckets_open != state.workload.buckets:
            state.workload = Workload(state.workload.gradient_bytes, state.workload.powersgd_bytes, state._buckets_open)
    return future
