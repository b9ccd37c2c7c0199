"""ds_lightning: distributed training strategies for PyTorch Lightning, selected with one string.

``import ds_lightning`` registers ``ds_mirrored`` (and later strategies) in Lightning's ``StrategyRegistry``.
"""

from ds_lightning.data.eval_shards import EvalShardError
from ds_lightning.environments import TFConfigEnvironment, TFConfigError
from ds_lightning.parameter_server import ServerLostError
from ds_lightning.pipeline.graph_split import TracingRefused
from ds_lightning.strategies import (
    ClusterStrategy,
    LayerSplitStrategy,
    MirroredStrategy,
    ParameterServerStrategy,
    PipelineStrategy,
    available_strategies,
)
from ds_lightning.testing import CommandError, ShapingUnsupportedError, SlurmError

__version__ = "0.1.0"

__all__ = [
    "ClusterStrategy",
    "CommandError",
    "EvalShardError",
    "LayerSplitStrategy",
    "MirroredStrategy",
    "ParameterServerStrategy",
    "PipelineStrategy",
    "ServerLostError",
    "ShapingUnsupportedError",
    "SlurmError",
    "TFConfigEnvironment",
    "TFConfigError",
    "TracingRefused",
    "__version__",
    "available_strategies",
]
