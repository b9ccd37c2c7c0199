"""Optimizer states of pipeline stages: consolidated into the single-device format and split back by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_lightning.pipeline import state as pipe_state


def _trained(model: nn.Module, groups) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(groups, lr=0.01)
    torch.manual_seed(0)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return opt


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))


def _groups(model: nn.Sequential, layers):
    decay = [p for i in layers for n, p in model[i].named_parameters() if n == "weight"]
    no_decay = [p for i in layers for n, p in model[i].named_parameters() if n == "bias"]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def test_consolidated_stage_states_equal_the_whole_models_state_and_split_back():
    whole = _model()
    order = [n for n, _ in whole.named_parameters()]
    expected = _trained(whole, _groups(whole, [0, 1, 2])).state_dict()

    stage_model = _model()  # same init, trained in two stages of the same parameters
    stage_names = {p: n for n, p in stage_model.named_parameters()}
    stages = [_groups(stage_model, [0, 1]), _groups(stage_model, [2])]
    opts = [torch.optim.Adam(g, lr=0.01) for g in stages]
    torch.manual_seed(0)
    stage_model(torch.randn(4, 3)).sum().backward()
    for opt in opts:
        opt.step()

    per_stage_groups = [pipe_state.group_names(opt, stage_names) for opt in opts]
    full_groups = pipe_state.full_group_names(per_stage_groups, order)
    assert full_groups == [["0.weight", "1.weight", "2.weight"], ["0.bias", "1.bias", "2.bias"]]
    merged = pipe_state.consolidate([pipe_state.named_state(opt, stage_names) for opt in opts], full_groups)

    assert [g["params"] for g in merged["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert [g["weight_decay"] for g in merged["param_groups"]] == [0.1, 0.0]
    assert merged["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(merged["state"][index][key], value)
    # A plain optimizer over the whole model accepts it.
    torch.optim.Adam(_groups(_model(), [0, 1, 2]), lr=0.01).load_state_dict(merged)

    # Split for a different layout: three stages of one layer each.
    for layer in range(3):
        local_groups = [[f"{layer}.weight"], [f"{layer}.bias"]]
        local = pipe_state.localize(merged, full_groups, local_groups)
        assert [g["params"] for g in local["param_groups"]] == [[0], [1]]
        torch.testing.assert_close(
            local["state"][0]["exp_avg"], expected["state"][full_groups[0].index(f"{layer}.weight")]["exp_avg"]
        )
        torch.testing.assert_close(local["state"][1]["exp_avg"], expected["state"][3 + layer]["exp_avg"])


def test_mismatched_group_sizes_are_refused_with_both_shapes():
    full = {"state": {}, "param_groups": [{"params": [0, 1], "lr": 0.1}]}
    with pytest.raises(ValueError, match=r"sizes \[2\].* gives \[3\]"):
        pipe_state.localize(full, [["a", "b", "c"]], [["a"]])


def test_stages_with_different_group_counts_are_refused():
    with pytest.raises(ValueError, match="different numbers of optimizer param groups"):
        pipe_state.full_group_names([[["a"]], [["b"], ["c"]]], ["a", "b", "c"])
