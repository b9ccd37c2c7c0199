"""The compression registry: every use asks the method, a method added from a test runs through ds_mirrored on 2 gloo
ranks, and a method refuses a use it does not serve with an error naming the value and the fix."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ds_lightning import MirroredStrategy, ParameterServerStrategy
from ds_lightning.comm.compression import (
    CompressionOptions,
    auto_candidates,
    create,
    get,
    names,
    register,
    unregister,
)
from ds_lightning.parameter_server.push_compression import PushCompressor
from tests.helpers import extra_compression
from tests.helpers.extra_compression import BATCH, LR, NAME, STEPS, Float64
from tests.helpers.runner import run_ranks


@pytest.fixture
def extra_method():
    """``fp64_test`` registered for one test, then removed (other tests list the built-in names in messages)."""
    register(Float64)
    yield Float64
    unregister(NAME)
    assert NAME not in names()


def test_the_built_in_methods_and_their_uses():
    assert names() == ("none", "fp16", "bf16", "powersgd", "topk", "auto")
    assert names("all_reduce") == ("none", "fp16", "bf16", "powersgd", "auto")
    assert names("two_level") == ("none", "fp16", "bf16", "powersgd")
    assert names("push") == ("none", "fp16", "bf16", "topk")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: MirroredStrategy(gradient_compression="topk"),
            r"'topk' does not work with ds_mirrored.*'powersgd'",
        ),
        (lambda: ParameterServerStrategy(gradient_compression="powersgd"), r"'powersgd' does not work .* 'topk'"),
        (lambda: PushCompressor("auto"), r"gradient_compression='auto' does not work with ds_parameter_server"),
        (lambda: MirroredStrategy(gradient_compression="auto", hierarchical=True), r"or set hierarchical=False"),
    ],
)
def test_an_unsupported_use_names_the_value_and_the_methods_that_serve_it(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_name_is_registered_once(extra_method):
    class Other(extra_method):
        pass

    with pytest.raises(ValueError, match=rf"gradient_compression='{NAME}' is already registered by .*Float64"):
        register(Other)
    assert get(NAME) is extra_method


def test_a_registered_method_serves_every_use_its_base_provides(extra_method):
    assert NAME in names("all_reduce") and NAME in names("two_level") and NAME in names("push")
    assert NAME not in [m.name for m in auto_candidates()]  # auto_candidate is off unless the class turns it on
    MirroredStrategy(gradient_compression=NAME, hierarchical=True)  # accepted at construction
    push = create(NAME, CompressionOptions(), use="push")
    grad = torch.randn(10)
    (payload,) = push.encode(grad)
    assert payload.dtype == torch.float64 and torch.equal(push.decode([payload], 10), grad)


@pytest.mark.multiprocess
def test_a_method_registered_from_a_test_trains_through_ds_mirrored_on_two_ranks(tmp_path, extra_method):
    out = tmp_path / "fp64"
    run = run_ranks("tests.helpers.extra_compression", [str(out)], 2, timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    ranks = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in (0, 1)]
    # Its hook ran at every step and sent float64: twice the bytes of a float32 all-reduce.
    for record in ranks:
        assert record["global_step"] == record["steps"] == STEPS
        assert record["dtypes"] == ["torch.float64"]
        assert record["bytes_per_step"] == 2 * record["uncompressed_bytes_per_step"] > 0
    # Parity with one process taking each step's global batch: both ranks' batches of 4, one mean over the 8.
    reference = extra_compression.model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for (x0, y0), (x1, y1) in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True):
        assert len(x0) == len(x1) == BATCH
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
        optimizer.step()
    for name, value in reference.state_dict().items():
        assert_close(ranks[0]["params"][name], value, atol=1e-6, rtol=1e-5)
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])
    assert not torch.equal(ranks[0]["params"]["0.weight"], extra_compression.model().state_dict()["0.weight"])
