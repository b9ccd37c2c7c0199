"""How many processes a scheduler started for this run, for strategies that train in one process."""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

__all__ = ["refuse_several_launched"]


def _launched() -> tuple[str, int] | None:
    """The launcher that started several processes of this run and how many (``None``: one, or no scheduler)."""
    if SLURMEnvironment.detect() and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "srun started SLURM_NTASKS", int(os.environ["SLURM_NTASKS"])
    if TorchElasticEnvironment.detect() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "torchrun started WORLD_SIZE", int(os.environ["WORLD_SIZE"])
    return None


def refuse_several_launched(strategy_name: str, alternative: str) -> None:
    """Refuse a launch of several processes for a strategy that trains in one: each would train a copy on its own.

    Raises:
        ValueError: naming the launcher, the number of processes, and the fix: one process, or ``alternative``.

    """
    launched = _launched()
    if launched is not None:
        what, count = launched
        raise ValueError(
            f"{strategy_name} trains in one process, but {what}={count} processes: each would train its own copy."
            " Start one process (one task: sbatch --nodes=1 --ntasks-per-node=1; torchrun --nproc-per-node=1), or"
            f" {alternative}."
        )
