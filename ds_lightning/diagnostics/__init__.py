"""Why a distributed run is stuck: torch's Flight Recorder read by a watch on every rank, and the verdict it gives."""

from ds_lightning.diagnostics.hang_verdict import Call, RankView, Verdict, judge
from ds_lightning.diagnostics.hang_watch import HangWatch, watch_strategy

__all__ = ["Call", "HangWatch", "RankView", "Verdict", "judge", "watch_strategy"]
