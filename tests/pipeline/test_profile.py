"""profile_layers without processes: what it measures, what it leaves as it was, and the bad values it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_lightning.pipeline import profile as profile_module
from ds_lightning.pipeline.profile import LayerProfile, profile_layers

CPU = torch.device("cpu")
F32 = 4  # bytes


class _ScriptedClock:
    """Stands in for the ``time`` module: each timed pass lasts the next of ``durations`` seconds."""

    def __init__(self, durations: list[float]) -> None:
        self._durations = list(durations)
        self._now = 0.0
        self._started = False

    def perf_counter(self) -> float:
        if self._started:
            self._now += self._durations.pop(0)
        self._started = not self._started
        return self._now


def test_one_profile_per_layer_with_parameter_and_output_bytes():
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)]
    profiles = profile_layers(layers, torch.randn(8, 16), CPU, repeats=2)
    assert len(profiles) == 3 and all(isinstance(p, LayerProfile) for p in profiles)
    # Parameters count twice (their gradients too); the output is what the pipeline keeps for the backward pass.
    assert [p.parameter_bytes for p in profiles] == [2 * (16 * 32 + 32) * F32, 0, 2 * (32 * 4 + 4) * F32]
    assert [p.activation_bytes for p in profiles] == [8 * 32 * F32, 8 * 32 * F32, 8 * 4 * F32]
    assert [p.memory_bytes for p in profiles] == [p.parameter_bytes + p.activation_bytes for p in profiles]
    assert all(p.seconds >= 0 for p in profiles)


def test_frozen_parameters_and_other_dtypes_are_counted_as_they_are():
    frozen = nn.Linear(4, 4).double()
    frozen.weight.requires_grad_(False)  # no gradient is kept for it: only the bias counts
    (profile,) = profile_layers([frozen], torch.randn(3, 4, dtype=torch.float64), CPU)
    assert profile.parameter_bytes == 2 * 4 * 8
    assert profile.activation_bytes == 3 * 4 * 8


def test_integer_inputs_are_fed_to_an_embedding_without_asking_for_their_gradient():
    layers = [nn.Embedding(10, 8), nn.Linear(8, 3)]
    tokens = torch.randint(0, 10, (4, 6))
    profiles = profile_layers(layers, tokens, CPU)
    assert [p.parameter_bytes for p in profiles] == [2 * 10 * 8 * F32, 2 * (8 * 3 + 3) * F32]
    assert [p.activation_bytes for p in profiles] == [4 * 6 * 8 * F32, 4 * 6 * 3 * F32]


def test_each_layer_runs_repeats_times_on_the_previous_layers_output():
    torch.manual_seed(0)
    layers = [nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)]
    sample = torch.randn(3, 5)
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    for layer, inputs in zip(layers, seen, strict=True):
        layer.register_forward_pre_hook(lambda module, args, inputs=inputs: inputs.append(args[0].detach().clone()))
    profile_layers(layers, sample, CPU, repeats=3)
    assert [len(inputs) for inputs in seen] == [3, 3, 3]
    with torch.no_grad():
        expected = [sample, layers[0](sample), torch.tanh(layers[0](sample))]
    for index, (inputs, want) in enumerate(zip(seen, expected, strict=True)):
        for got in inputs:
            torch.testing.assert_close(got, want, msg=f"layer {index}")


def test_seconds_is_the_median_of_the_passes_after_the_warm_up(monkeypatch):
    # Layer 0's warm-up takes 100 s: counted, it would move the median from 2 to 2.5. Layer 1: median of 5, 9, 4.
    monkeypatch.setattr(profile_module, "time", _ScriptedClock([100, 1, 3, 2, 50, 5, 9, 4]))
    profiles = profile_layers([nn.Linear(2, 2), nn.Linear(2, 2)], torch.randn(1, 2), CPU, repeats=4)
    assert [p.seconds for p in profiles] == [2, 5]


def test_gradients_and_weights_are_left_as_they_were():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 2)]
    kept = torch.full((4, 4), 7.0)
    layers[0].weight.grad = kept
    weights = [p.detach().clone() for layer in layers for p in layer.parameters()]
    profile_layers(layers, torch.randn(2, 4), CPU, repeats=3)
    assert layers[0].weight.grad is kept and torch.equal(kept, torch.full((4, 4), 7.0))
    assert layers[0].bias.grad is None
    assert all(p.grad is None for p in layers[1].parameters())
    for before, after in zip(weights, [p for layer in layers for p in layer.parameters()], strict=True):
        assert torch.equal(before, after)
    assert all(p.device == CPU for layer in layers for p in layer.parameters())


@pytest.mark.parametrize("repeats", [1, 0, -3])
def test_fewer_than_two_repeats_are_refused_naming_the_value(repeats):
    with pytest.raises(ValueError, match=rf"repeats={repeats} must be >= 2 \(the first pass is a warm-up\)"):
        profile_layers([nn.Linear(2, 2)], torch.randn(1, 2), CPU, repeats=repeats)
