"""Diagnostics for distributed runs: where the time goes, and why a run is stuck.

``DistributedReport``'s measurement (each rank's step split into phases, the collectives' payload, who holds the run
back), and the hang diagnosis (torch's Flight Recorder read by a watch on every rank, and its verdict).
"""

from ds_lightning.diagnostics.hang_verdict import Call, HangVerdict, RankView, judge
from ds_lightning.diagnostics.hang_watch import HangWatch, watch_strategy
from ds_lightning.diagnostics.payload_bytes import PayloadCounter
from ds_lightning.diagnostics.report import RankSummary, Verdict, verdict
from ds_lightning.diagnostics.step_times import PHASES, StepClock, StepTime, step_clock

__all__ = [
    "PHASES",
    "Call",
    "HangVerdict",
    "HangWatch",
    "PayloadCounter",
    "RankSummary",
    "RankView",
    "StepClock",
    "StepTime",
    "Verdict",
    "judge",
    "step_clock",
    "verdict",
    "watch_strategy",
]
