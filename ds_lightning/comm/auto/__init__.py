"""``gradient_compression="auto"``: probe the link, predict each compression's step time, run the fastest.

:mod:`~ds_lightning.comm.auto.probe` measures latency and bandwidth with timed all-reduces (the slowest rank's figures,
identical everywhere), :mod:`~ds_lightning.comm.auto.model` predicts a step's time under ``none``, ``fp16`` and
``powersgd`` (at the user's rank, a floor auto never lowers) and :mod:`~ds_lightning.comm.auto.hook` is the one DDP
comm hook that runs the choice and re-decides every ``auto_interval`` steps.
"""

from ds_lightning.comm.auto.hook import AutoDecision, AutoState, auto_hook
from ds_lightning.comm.auto.model import AUTO_CANDIDATES, AllReduceFit, Choice, LinkFigures, Workload, choose
from ds_lightning.comm.auto.probe import compression_compute, fit_line, probe_link

__all__ = [
    "AUTO_CANDIDATES",
    "AllReduceFit",
    "AutoDecision",
    "AutoState",
    "Choice",
    "LinkFigures",
    "Workload",
    "auto_hook",
    "choose",
    "compression_compute",
    "fit_line",
    "probe_link",
]
