"""What callbacks ask a strategy: each capability's value for every ds strategy and for Lightning's own."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, StrategyRegistry

from ds_lightning.strategies import (
    ClusterStrategy,
    LayerSplitStrategy,
    MirroredStrategy,
    ParameterServerStrategy,
    PipelineStrategy,
)
from ds_lightning.strategies.capabilities import LIGHTNING_DEFAULTS, StrategyCapabilities, capabilities_of

# One row per strategy: the capabilities that differ from Lightning's own strategies (all others are the default).
EXPECTED = {
    "ds_mirrored": {"weights_rank_gradients": True},
    "ds_pipeline": {"precision_plugin_wraps_forward": False},
    "ds_parameter_server": {
        "agrees_over_default_group": False,
        "saves_from_chief_alone": True,
        "steps_optimizer_on_servers": True,
    },
    "ds_model_parallel": {},
    "ds_cluster_base": {},
    "ddp": {},
    "fsdp": {},
    "single_device": {},
}


def _strategy(name: str) -> object:
    return {
        "ds_mirrored": MirroredStrategy,
        "ds_pipeline": PipelineStrategy,
        "ds_parameter_server": ParameterServerStrategy,
        "ds_model_parallel": LayerSplitStrategy,
        "ds_cluster_base": ClusterStrategy,
        "ddp": DDPStrategy,
        "fsdp": FSDPStrategy,
        "single_device": lambda: SingleDeviceStrategy(device=torch.device("cpu")),
    }[name]()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_capability_per_strategy(name):
    capabilities = capabilities_of(_strategy(name))
    for field in fields(StrategyCapabilities):
        expected = EXPECTED[name].get(field.name, getattr(LIGHTNING_DEFAULTS, field.name))
        assert getattr(capabilities, field.name) is expected, (name, field.name)


def test_the_defaults_are_lightnings_behaviour():
    assert (
        StrategyCapabilities(
            precision_plugin_wraps_forward=True,
            agrees_over_default_group=True,
            saves_from_chief_alone=False,
            steps_optimizer_on_servers=False,
            weights_rank_gradients=False,
        )
        == LIGHTNING_DEFAULTS
    )


def test_registered_names_resolve_to_the_same_capabilities():
    # What a Trainer built from a YAML name gets: the registry's class, so the class attribute.
    for name in ("ds_mirrored", "ds_pipeline", "ds_parameter_server"):
        strategy = StrategyRegistry.get(name)
        assert capabilities_of(strategy) == capabilities_of(_strategy(name))


def test_an_object_without_a_declaration_or_with_a_foreign_one_gets_the_defaults():
    class Declares:
        capabilities = {"steps_optimizer_on_servers": True}  # not a StrategyCapabilities: ignored

    assert capabilities_of(object()) is LIGHTNING_DEFAULTS
    assert capabilities_of(Declares()) is LIGHTNING_DEFAULTS
