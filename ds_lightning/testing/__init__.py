"""Test multi-host configurations on one machine: a network-namespace cluster, and clean process launches.

:class:`~ds_lightning.testing.netns.Cluster` builds hosts out of Linux network namespaces on one bridge (root and
iproute2 needed; :func:`~ds_lightning.testing.netns.missing_requirements` says what is missing), so a ``TF_CONFIG``
cluster, a cut link or a slow link can be tried without a second machine. ds_lightning's own tests and benchmarks use
it too. :class:`~ds_lightning.testing.slurm.SlurmCluster` runs a real SLURM cluster (munge, slurmctld, a slurmd per
host) on such hosts.
"""

from ds_lightning.testing._iproute import CommandError
from ds_lightning.testing.netns import (
    Cluster,
    Host,
    ShapingUnsupportedError,
    missing_requirements,
    netem_available,
)
from ds_lightning.testing.processes import free_port, worker_env
from ds_lightning.testing.slurm import SlurmCluster, SlurmError, missing_slurm

__all__ = [
    "Cluster",
    "CommandError",
    "Host",
    "ShapingUnsupportedError",
    "SlurmCluster",
    "SlurmError",
    "free_port",
    "missing_requirements",
    "missing_slurm",
    "netem_available",
    "worker_env",
]
