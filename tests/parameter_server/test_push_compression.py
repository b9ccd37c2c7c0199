"""Push compression: round trips, top-k count and error feedback, payload sizes and shapes, state, errors."""

from __future__ import annotations

import math

import pytest
import torch

from ds_lightning.parameter_server.push_compression import PushCompressor, topk_count


def test_none_round_trip_is_exact_and_sends_the_gradient_itself():
    grad = torch.randn(100, generator=torch.Generator().manual_seed(0))
    compressor = PushCompressor("none")
    payload = compressor.encode(grad)
    assert len(payload) == 1 and payload[0] is grad
    assert torch.equal(compressor.decode(payload, 100), grad)
    assert PushCompressor.payload_bytes(payload) == 400


@pytest.mark.parametrize(("name", "dtype", "rtol"), [("fp16", torch.float16, 2**-11), ("bf16", torch.bfloat16, 2**-8)])
def test_half_width_round_trip_within_dtype_tolerance(name, dtype, rtol):
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    compressor = PushCompressor(name)
    payload = compressor.encode(grad)
    assert [t.dtype for t in payload] == [dtype]
    decoded = compressor.decode(payload, 1000)
    assert decoded.dtype == torch.float32
    err = (decoded - grad).abs()
    assert bool((err <= rtol * grad.abs() + 1e-7).all())  # round to nearest: half an ulp
    assert bool((err > 0).any())  # really compressed
    assert compressor.payload_bytes(payload) == 2000


def test_topk_sends_exactly_k_largest_entries():
    grad = torch.tensor([0.1, -5.0, 0.3, 2.0, -0.2, 0.0, 4.0, -0.05, 1.0, 0.7])
    compressor = PushCompressor("topk", topk_ratio=0.3)
    indices, values = compressor.encode(grad)
    assert indices.dtype == torch.int64
    assert indices.tolist() == [1, 3, 6]
    assert values.tolist() == [-5.0, 2.0, 4.0]
    decoded = compressor.decode([indices, values], 10)
    assert torch.equal(decoded, torch.tensor([0, -5.0, 0, 2.0, 0, 0, 4.0, 0, 0, 0]))
    assert torch.equal(compressor.residual, grad - decoded)
    assert compressor.payload_bytes([indices, values]) == 3 * 8 + 3 * 4


@pytest.mark.parametrize(
    ("numel", "ratio", "k"), [(100, 0.07, 7), (100, 0.071, 8), (10, 0.01, 1), (5, 1.0, 5), (0, 0.5, 0)]
)
def test_topk_count(numel, ratio, k):
    assert topk_count(numel, ratio) == k


def test_topk_count_on_random_sizes_is_ceil_and_used_by_encode():
    compressor = PushCompressor("topk", topk_ratio=0.013)
    for numel in [1, 7, 77, 1000, 12345]:
        indices, values = compressor.encode(torch.randn(numel))
        compressor.reset()
        assert indices.numel() == values.numel() == max(1, math.ceil(0.013 * numel))


def test_topk_error_feedback_sum_of_decoded_pushes_tracks_the_true_sum_exactly():
    # Integer-valued float32 gradients keep every sum exact, so the identity holds bit for bit.
    gen = torch.Generator().manual_seed(2)
    sender, receiver = PushCompressor("topk", topk_ratio=0.05), PushCompressor("topk", topk_ratio=0.05)
    true_sum = torch.zeros(200)
    sent_sum = torch.zeros(200)
    residual_max = []
    for _ in range(1000):
        grad = torch.randint(-20, 21, (200,), generator=gen).float()
        payload = sender.encode(grad)
        assert payload[0].numel() == 10
        true_sum += grad
        sent_sum += receiver.decode(payload, 200)
        assert torch.equal(true_sum - sent_sum, sender.residual)
        residual_max.append(float(sender.residual.abs().max()))
    # the residual stays bounded (a random walk of unsent gradients would keep growing) ...
    assert max(residual_max[500:]) <= 1.25 * max(residual_max[50:150])
    # ... so the relative error of the accumulated update shrinks as the sums grow
    assert float(sender.residual.norm() / true_sum.norm()) < 0.1


def test_topk_float_gradients_converge_with_error_feedback_but_not_without():
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(500, generator=gen, dtype=torch.float64) + 0.1 for _ in range(400)]
    true_sum = torch.stack(grads).sum(0)
    with_ef, without_ef = PushCompressor("topk", 0.02), PushCompressor("topk", 0.02, error_feedback=False)
    sum_ef = sum(with_ef.decode(with_ef.encode(g), 500, torch.float64) for g in grads)
    sum_plain = sum(without_ef.decode(without_ef.encode(g), 500, torch.float64) for g in grads)
    torch.testing.assert_close(true_sum - sum_ef, with_ef.residual)
    assert without_ef.residual is None
    err_ef = float((true_sum - sum_ef).norm() / true_sum.norm())
    err_plain = float((true_sum - sum_plain).norm() / true_sum.norm())
    assert err_ef < 0.5 * err_plain


def test_decode_works_without_sender_state_and_in_another_dtype():
    sender = PushCompressor("topk", 0.5)
    payload = sender.encode(torch.tensor([1.0, -3.0, 0.5, 2.0]))
    dense = PushCompressor("topk", 0.5).decode(payload, 4, dtype=torch.float64)
    assert dense.dtype == torch.float64
    assert dense.tolist() == [0.0, -3.0, 0.0, 2.0]


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "topk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_payload_shapes_match_encode(name, dtype):
    numel, ratio = 1234, 0.037
    payload = PushCompressor(name, topk_ratio=ratio).encode(torch.randn(numel, dtype=dtype))
    shapes = PushCompressor.payload_shapes(name, numel, ratio, dtype=dtype)
    assert [(tuple(t.shape), t.dtype) for t in payload] == shapes
    # pre-allocated receive buffers decode like the payload itself
    buffers = [torch.empty(shape, dtype=dt) for shape, dt in shapes]
    for buf, t in zip(buffers, payload, strict=True):
        buf.copy_(t)
    compressor = PushCompressor(name, topk_ratio=ratio)
    assert torch.equal(compressor.decode(buffers, numel, dtype), compressor.decode(payload, numel, dtype))


def test_payload_shapes_values():
    assert PushCompressor.payload_shapes("topk", 1000, 0.01) == [((10,), torch.int64), ((10,), torch.float32)]
    assert PushCompressor.payload_shapes("bf16", 8) == [((8,), torch.bfloat16)]
    assert PushCompressor.payload_shapes("none", 8) == [((8,), torch.float32)]


def test_state_dict_round_trips_the_residual(tmp_path):
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(64, generator=gen) for _ in range(6)]
    a = PushCompressor("topk", 0.1)
    for g in grads[:3]:
        a.encode(g)
    state = a.state_dict()
    assert list(state) == ["residual"] and isinstance(state["residual"], torch.Tensor)
    torch.save(state, tmp_path / "push.pt")
    b = PushCompressor("topk", 0.1)
    b.load_state_dict(torch.load(tmp_path / "push.pt", weights_only=True))
    assert torch.equal(b.residual, a.residual)
    for g in grads[3:]:
        pa, pb = a.encode(g), b.encode(g)
        assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    fresh = PushCompressor("topk", 0.1)
    assert fresh.state_dict()["residual"].numel() == 0
    fresh.load_state_dict(fresh.state_dict())
    assert fresh.residual is None


def test_state_dict_is_a_copy():
    c = PushCompressor("topk", 0.5)
    c.encode(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    state = c.state_dict()
    state["residual"].fill_(9.0)
    assert c.residual.tolist() == [1.0, 2.0, 0.0, 0.0]


def test_residual_for_a_compressor_without_one_is_refused():
    with pytest.raises(ValueError, match="gradient_compression='fp16' with error_feedback=True keeps none"):
        PushCompressor("fp16").load_state_dict({"residual": torch.ones(3)})
    with pytest.raises(ValueError, match="error_feedback=False keeps none"):
        PushCompressor("topk", error_feedback=False).load_state_dict({"residual": torch.ones(3)})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"name": "int8"},
            r"gradient_compression='int8' is not supported; choose one of 'none', 'fp16', 'bf16', 'topk'\.",
        ),
        ({"name": "topk", "topk_ratio": 0}, r"topk_ratio=0 must be a number in \(0, 1\]"),
        ({"name": "topk", "topk_ratio": 1.5}, "topk_ratio=1.5"),
        ({"name": "topk", "topk_ratio": float("nan")}, "topk_ratio=nan"),
        ({"name": "topk", "topk_ratio": True}, "topk_ratio=True"),
        ({"name": "topk", "error_feedback": 1}, "error_feedback=1 must be True or False"),
    ],
)
def test_bad_options_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PushCompressor(**kwargs)


def test_encode_and_decode_errors():
    c = PushCompressor("topk", 0.5)
    with pytest.raises(ValueError, match=r"flat 1-D gradient, got shape \(2, 3\); pass grad.reshape\(-1\)"):
        c.encode(torch.ones(2, 3))
    c.encode(torch.ones(4))
    with pytest.raises(ValueError, match="gradient has 5 entries but the top-k residual has 4"):
        c.encode(torch.ones(5))
    with pytest.raises(ValueError, match="'topk' payload holds 2 tensor"):
        c.decode([torch.ones(4)], 4)
    with pytest.raises(ValueError, match=r"indices span 0\.\.7, outside a gradient of numel=4"):
        c.decode([torch.tensor([0, 7]), torch.ones(2)], 4)
    with pytest.raises(ValueError, match="int64 indices"):
        c.decode([torch.tensor([0, 1], dtype=torch.int32), torch.ones(2)], 4)
    with pytest.raises(ValueError, match=r"'none' payload has shape \(3,\); expected \(4,\)"):
        PushCompressor("none").decode([torch.ones(3)], 4)
    with pytest.raises(ValueError, match="gradient_compression='x'"):
        PushCompressor.payload_shapes("x", 4)  # type: ignore[arg-type]
