"""The single-process optimizer layout: parameter numbers by name, and the name-keyed form FSDP2 uses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_lightning.sharding.optimizer_layout import index_by_name, named_state, numbered_state, parameter_names


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    # Groups out of module order: the numbering follows the groups, not the module.
    optimizer = torch.optim.Adam([{"params": model[1].parameters()}, {"params": model[0].parameters(), "lr": 0.1}])
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_parameters_are_numbered_in_the_order_of_the_groups():
    model, optimizer = _model_and_optimizer()
    assert parameter_names(model, optimizer) == ["1.weight", "1.bias", "0.weight", "0.bias"]
    assert index_by_name(model, optimizer) == {"1.weight": 0, "1.bias": 1, "0.weight": 2, "0.bias": 3}


def test_named_then_numbered_gives_the_optimizers_own_state_dict_back():
    model, optimizer = _model_and_optimizer()
    plain = optimizer.state_dict()
    named = named_state(plain, model, optimizer)
    assert sorted(named["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert named["param_groups"][0]["params"] == ["1.weight", "1.bias"]
    again = numbered_state(named)
    assert again["param_groups"] == plain["param_groups"]
    assert sorted(again["state"]) == sorted(plain["state"])
    for index, state in plain["state"].items():
        torch.testing.assert_close(again["state"][index]["exp_avg"], state["exp_avg"])


def test_a_state_of_another_optimizer_is_refused_with_the_counts():
    model, optimizer = _model_and_optimizer()
    other = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="covers 2 parameters, but this optimizer steps 4"):
        named_state(other.state_dict(), model, optimizer)
