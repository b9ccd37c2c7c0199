"""The pipeline schedules torch provides, what each needs, and a forward-only variant for evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.pipelining import schedules as _torch_schedules

from ds_lightning import _validation as check

__all__ = [
    "SCHEDULES",
    "ScheduleName",
    "ScheduleSpec",
    "canonical_name",
    "check_microbatches",
    "make_forward_only",
    "resolve_stages_per_rank",
    "schedule_spec",
]

ScheduleName = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]


@dataclass(frozen=True)
class ScheduleSpec:
    """What a torch schedule needs from the layout.

    Attributes:
        torch_class: the ``torch.distributed.pipelining`` schedule class.
        multi_stage: runs several stages per process (``PipelineScheduleMulti``).
        style: ``"loop"`` (rank ``r`` runs stages ``r, r+p, ...``) or ``"v"`` (rank ``r`` runs ``r`` and ``2p-1-r``).
        needs_microbatches_ge_stages: torch refuses fewer micro-batches than stages.

    """

    torch_class: type
    multi_stage: bool
    style: Literal["loop", "v"]
    needs_microbatches_ge_stages: bool


_TABLE = (
    # name, torch class name, multi-stage, style, needs n_microbatches >= stages
    ("GPipe", "ScheduleGPipe", False, "loop", False),
    ("1F1B", "Schedule1F1B", False, "loop", True),
    ("Interleaved1F1B", "ScheduleInterleaved1F1B", True, "loop", False),
    ("LoopedBFS", "ScheduleLoopedBFS", True, "loop", False),
    ("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", True, "loop", False),
    ("ZBVZeroBubble", "ScheduleZBVZeroBubble", True, "v", True),
    ("DualPipeV", "ScheduleDualPipeV", True, "v", True),
)

#: The schedules this torch provides (older releases lack the newest ones; ds_pipeline is tested with torch 2.13).
SCHEDULES: dict[str, ScheduleSpec] = {
    name: ScheduleSpec(getattr(_torch_schedules, cls), multi, style, ge)  # type: ignore[arg-type]
    for name, cls, multi, style, ge in _TABLE
    if hasattr(_torch_schedules, cls)
}


def schedule_spec(name: str) -> ScheduleSpec:
    """Look a schedule up by its torch name, case-insensitively; unknown names list the valid ones."""
    for key, spec in SCHEDULES.items():
        if key.lower() == str(name).lower():
            return spec
    if any(row[0].lower() == str(name).lower() for row in _TABLE):
        raise ValueError(
            f"schedule={name!r} is not in this torch ({torch.__version__}); upgrade torch or choose one of "
            f"{list(SCHEDULES)}."
        )
    raise ValueError(f"schedule={name!r} is not a torch pipeline schedule; choose one of {list(SCHEDULES)}.")


def canonical_name(name: str) -> str:
    """The torch spelling of a schedule name (``"gpipe" -> "GPipe"``)."""
    spec = schedule_spec(name)
    return next(key for key, value in SCHEDULES.items() if value is spec)


def resolve_stages_per_rank(name: str, stages_per_rank: int | None) -> int:
    """The stages each process runs under a schedule: ``None`` picks 2 for multi-stage schedules, else 1.

    Raises:
        ValueError: for a count the schedule cannot run, naming the schedule and the fix.

    """
    spec = schedule_spec(name)
    default = 2 if spec.multi_stage else 1
    if stages_per_rank is None:
        return default
    check.integer("stages_per_rank", stages_per_rank, 1, f"PipelineStrategy(stages_per_rank={default})")
    if not spec.multi_stage and stages_per_rank != 1:
        raise ValueError(
            f"schedule={canonical_name(name)!r} runs one stage per process, but stages_per_rank={stages_per_rank}; use "
            "schedule='Interleaved1F1B' (or another multi-stage schedule) for several stages per process."
        )
    if spec.style == "v" and stages_per_rank != 2:
        raise ValueError(
            f"schedule={canonical_name(name)!r} runs exactly 2 stages per process (a V shape), but "
            f"stages_per_rank={stages_per_rank}; leave stages_per_rank unset."
        )
    return stages_per_rank


def check_microbatches(name: str, n_microbatches: int, stages: int, pipeline_size: int) -> None:
    """Refuse micro-batch counts the schedule cannot run, before any process starts work.

    Raises:
        ValueError: naming the schedule, the counts and the smallest valid ``n_microbatches``.

    """
    spec = schedule_spec(name)
    if spec.needs_microbatches_ge_stages and n_microbatches < stages:
        raise ValueError(
            f"schedule={canonical_name(name)!r} needs at least as many micro-batches as stages, but "
            f"n_microbatches={n_microbatches} < {stages} stages. Set n_microbatches>={stages}, or use schedule='GPipe'."
        )
    # Both interleaved schedules run rounds of n_microbatches // pipeline size micro-batches.
    if canonical_name(name) in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pipeline_size)
        if n_microbatches % rounds:
            raise ValueError(
                f"schedule={canonical_name(name)!r} needs n_microbatches to be a multiple of "
                f"n_microbatches // pipeline size ({rounds}); n_microbatches={n_microbatches} is not. Use a multiple "
                f"of {pipeline_size}."
            )


def make_forward_only(schedule: object) -> None:
    """Make a V-shaped runtime schedule built without a loss run forward actions only.

    torch 2.13's ZBVZeroBubble and DualPipeV keep their backward actions in ``eval()`` and fail with "can't
    steal_bwd_input if this stage doesn't have backward". Keeping only the forward actions of the same order (the
    forward halves of DualPipeV's overlapped actions included) and adding the sends and receives they need, with
    torch's own lowering pass, gives a valid forward pipeline. torch's validator is skipped because it insists on
    a backward for every micro-batch.
    """
    forward = _torch_schedules._ComputationType.FORWARD
    overlap = _torch_schedules._ComputationType.OVERLAP_F_B
    order = {}
    for rank, actions in schedule.pipeline_order.items():  # type: ignore[attr-defined]
        kept = []
        for action in actions:
            if action is None:
                continue
            if action.computation_type == forward:
                kept.append(action)
            elif action.computation_type == overlap:
                kept.extend(sub for sub in action.sub_actions or () if sub.computation_type == forward)
        order[rank] = kept
    stage_to_rank = schedule.stage_index_to_group_rank  # type: ignore[attr-defined]
    schedule.pipeline_order_with_comms = _torch_schedules._add_send_recv(  # type: ignore[attr-defined]
        order,
        stage_to_rank=lambda stage: stage_to_rank[stage],
        num_stages=schedule._num_stages,  # type: ignore[attr-defined]
    )
