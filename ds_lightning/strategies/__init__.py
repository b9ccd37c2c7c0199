"""Lightning strategies of ds_lightning; importing this package registers their ``ds_*`` names."""

from lightning.pytorch.strategies import StrategyRegistry

from ds_lightning.strategies.base import ClusterStrategy
from ds_lightning.strategies.layer_split import LayerSplitStrategy
from ds_lightning.strategies.mirrored import MirroredStrategy
from ds_lightning.strategies.parameter_server import ParameterServerStrategy
from ds_lightning.strategies.pipeline import PipelineStrategy

__all__ = [
    "ClusterStrategy",
    "LayerSplitStrategy",
    "MirroredStrategy",
    "ParameterServerStrategy",
    "PipelineStrategy",
    "available_strategies",
]

_STRATEGIES = (MirroredStrategy, PipelineStrategy, LayerSplitStrategy, ParameterServerStrategy)

for _cls in _STRATEGIES:
    _cls.register_strategies(StrategyRegistry)


def available_strategies() -> list[str]:
    """The ``ds_*`` names that ``Trainer(strategy=...)`` accepts once ``ds_lightning`` is imported."""
    return sorted(name for name in StrategyRegistry.available_strategies() if name.startswith("ds_"))
