"""Diagnostics for distributed runs: where step time goes on each rank, collective payload, and who holds a run back."""

from ds_lightning.diagnostics.payload_bytes import PayloadCounter
from ds_lightning.diagnostics.report import RankSummary, Verdict, verdict
from ds_lightning.diagnostics.step_times import PHASES, StepClock, StepTime, step_clock

__all__ = ["PHASES", "PayloadCounter", "RankSummary", "StepClock", "StepTime", "Verdict", "step_clock", "verdict"]
