"""The one DDP comm hook of ``gradient_compression="auto"``: it runs the current choice and re-decides on schedule.

DDP accepts one ``register_comm_hook`` per model (pytorch issue 102721), so the hook registered at set-up stays and
dispatches each bucket to the hook of the current choice (one of the registry's candidates: ``none``, ``fp16`` and
``powersgd`` built in). At the first bucket of a step the hook may re-decide: every ``interval`` gradient
synchronisations it re-probes the link, and at the step a candidate's warm-up ends (PowerSGD's ``start_iter``) it
re-decides on the last figures. Rank 0 decides and broadcasts its choice, so every rank
runs the same collectives even when the ranks' step times differ. Collectives are issued from the hook's thread at
the first bucket of a step, before any of that step's all-reduces: every rank issues them in the same order.

Switching into a method tells it so (:meth:`~ds_lightning.comm.compression.base.Compression.chosen`): PowerSGD then
clears its error feedback, a residual from the last time it ran that would apply an old update a second time.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ds_lightning.comm.auto.model import Choice, LinkFigures, Workload, choose
from ds_lightning.comm.auto.probe import PROBE_BYTES, compression_compute, probe_link
from ds_lightning.comm.wire import WireLog

if TYPE_CHECKING:
    from ds_lightning.comm.compression.base import Compression

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

    def message(self) -> str:
        """The log line."""
        f = self.figures
        predicted = ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in self.predicted_s.items())
        compute = ", ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in f.compress_s.items()) or "none"
        step = f"{self.step_s * 1e3:.2f} ms" if self.step_s is not None else "not yet timed"
        return (
            f"ds_mirrored auto compression at step {self.step}: {self.choice} (was {self.previous};"
            f" {'probed' if self.probed else 'last figures'}). Link over {f.world_size} ranks: latency"
            f" {f.float32.latency_s * 1e6:.1f} us/round, bandwidth {f.float32.bandwidth / 1e6:.1f} MB/s (float32),"
            f" {f.float16.bandwidth / 1e6:.1f} MB/s (float16); compression compute {compute}; step {step};"
            f" predicted ms/step: {predicted}."
        )


@dataclass
class AutoState:
    """State of :func:`auto_hook` on one rank.

    Attributes:
        process_group: the group gradients are all-reduced over (``None``: the default group).
        device: where gradients live.
        candidates: the methods to choose among, in the registry's order (the same on every rank).
        hooks: ``(state, hook)`` per candidate name, all logging into :attr:`wire` (each candidate's own warm-up
            off: this state keeps a candidate out until its ``warmup_steps``).
        wire: what every choice's collectives sent (one log, shared by the candidates' hooks).
        workload: what a step sends (``buckets`` is updated from the buckets DDP really hands over).
        shapes: the shapes of the parameters DDP reduces, for timing each candidate's compute.
        interval: gradient synchronisations between probes.
        choice: the compression running now.
        step: gradient synchronisations so far.
        figures: the last probe's figures.
        override: figures to decide on instead of probing (test and what-if use); only rank 0's matter.
        decisions: the latest decisions, oldest first.
        probe_sizes: all-reduce sizes of a probe, in bytes.

    """

    process_group: dist.ProcessGroup | None
    device: torch.device
    candidates: tuple["Compression", ...]
    hooks: dict[str, tuple[Any, Hook]]
    wire: WireLog
    workload: Workload
    shapes: list[tuple[int, ...]]
    interval: int = 500
    choice: str = ""
    step: int = 0
    figures: LinkFigures | None = None
    override: LinkFigures | None = None
    decisions: deque[AutoDecision] = field(default_factory=lambda: deque(maxlen=64))
    probe_sizes: tuple[int, ...] = PROBE_BYTES
    _compress_s: dict[str, float] | None = None
    _step_started: float | None = None
    # The first step after set-up or a restore is not timed: it holds torch.compile's compilation (seconds) and lazy
    # initialisation, and as the only figure at the first decision it made every compression look worthless.
    _first_step_timed: bool = False
    _in_step: bool = False
    _buckets_open: int = 0
    _probed_this_step: bool = False
    _step_times: deque[float] = field(default_factory=lambda: deque(maxlen=32))

    def __post_init__(self) -> None:
        self.choice = self.choice or next(c.name for c in self.candidates if c.lossless)

    @property
    def start_iter(self) -> int:
        """Gradient synchronisations before every candidate may be chosen (the longest warm-up)."""
        return max((c.warmup_steps for c in self.candidates), default=0)

    def _method(self, name: str) -> "Compression":
        return next(c for c in self.candidates if c.name == name)

    def probe(self) -> LinkFigures:
        """Measure the link (a collective: every rank calls it at the same point)."""
        if self._compress_s is None:
            probes = {c.name: c.compute_probe(self.shapes, self.device) for c in self.candidates}
            self._compress_s = compression_compute({n: p for n, p in probes.items() if p is not None}, self.device)
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
        allowed = [c.name for c in self.candidates if self.step >= c.warmup_steps]
        made: Choice = choose(
            figures, self.workload, current=self.choice, step_s=step_s, candidates=self.candidates, allowed=allowed
        )
        names = [c.name for c in self.candidates]
        chosen = torch.tensor([names.index(made.name)], dtype=torch.int64, device=self.device)
        source = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        dist.broadcast(chosen, src=source, group=self.process_group)
        name = names[int(chosen.item())]
        decision = AutoDecision(self.step, name, self.choice, probe, figures, made.predicted_s, step_s)
        self.decisions.append(decision)
        if name != self.choice:
            self._method(name).chosen()  # e.g. PowerSGD drops stale error feedback (module docstring)
            self._step_times.clear()  # step times of the old choice no longer describe the new one
        self.choice = name
        if dist.get_rank() == 0:
            rank_zero_info(decision.message())
            log.debug("auto compression figures: %s", figures.as_dict())
        return decision

    def _begin_step(self) -> None:
        now = time.perf_counter()
        if self._step_started is not None and not self._probed_this_step:
            if self._first_step_timed:
                self._step_times.append(now - self._step_started)
            self._first_step_timed = True
        self._probed_this_step = False
        due_probe = self.step > 0 and self.step % self.interval == 0
        warmup_over = self.step > 0 and any(
            self.step == c.warmup_steps and c.name != self.choice for c in self.candidates
        )
        if due_probe or warmup_over:
            self.decide(probe=due_probe)
            self._probed_this_step = due_probe
        self._step_started = time.perf_counter() if self._probed_this_step else now

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers and tensors: the choice, the step count, the last figures and the candidates' states.

        Each checkpointed candidate's state is under its name (PowerSGD's memory under ``"powersgd"``).
        """
        out: dict[str, Any] = {
            "choice": self.choice,
            "step": self.step,
            "figures": self.figures.as_dict() if self.figures is not None else None,
        }
        out.update({c.name: c.state_dict() for c in self.candidates if c.checkpointed})
        return out

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict`'s output; probes then fall on the same steps as in the saved run."""
        self.choice = str(state["choice"])
        self.step = int(state["step"])
        self.figures = LinkFigures.from_dict(state["figures"]) if state.get("figures") is not None else self.figures
        for candidate in self.candidates:
            if candidate.checkpointed and candidate.name in state:
                candidate.load_state_dict(state[candidate.name], device=device)
        self._step_times.clear()
        self._step_started = None
        self._first_step_timed = False


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
            state.workload = Workload(state.workload.gradient_bytes, state.workload.sent_bytes, state._buckets_open)
    return future
