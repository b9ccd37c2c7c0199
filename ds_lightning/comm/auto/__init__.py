"""``gradient_compression="auto"``: probe the link, predict each compression's step time, run the fastest.

:mod:`~ds_lightning.comm.auto.probe` measures latency and bandwidth with timed all-reduces (the slowest rank's figures,
identical everywhere), :mod:`~ds_lightning.comm.auto.model` predicts a step's time under each candidate of the
compression registry (``none``, ``fp16`` and ``powersgd`` at the user's rank, a floor auto never lowers) and
:mod:`~ds_lightning.comm.auto.hook` is the one DDP comm hook that runs the choice and re-decides every
``auto_interval`` steps. The ``"auto"`` method itself is :mod:`ds_lightning.comm.compression.auto`.
"""

from ds_lightning.comm.auto.hook import AutoDecision, AutoState, auto_hook
from ds_lightning.comm.auto.model import AllReduceFit, Choice, LinkFigures, Workload, choose
from ds_lightning.comm.auto.probe import compression_compute, fit_line, probe_link

__all__ = [
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
