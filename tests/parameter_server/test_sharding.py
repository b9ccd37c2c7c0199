"""Sharding parameters across parameter servers: coverage, splitting, balance, determinism, encoding, errors."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch import nn

from ds_lightning.parameter_server.sharding import ParameterShardPlan, ShardSlice, plan_shards

KIB = 1024


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _mixed() -> dict[str, torch.Tensor]:
    """A big embedding, a 1-row matrix, a scalar, a zero-row tensor and small odd shapes."""
    torch.manual_seed(1)
    return {
        "emb.weight": torch.randn(1000, 48),
        "row.weight": torch.randn(1, 3000),
        "scale": torch.randn(()),
        "empty": torch.randn(0, 7),
        "conv.weight": torch.randn(16, 3, 5, 5),
        "conv.bias": torch.randn(16),
        "head.weight": torch.randn(10, 48),
    }


def _roundtrip(plan: ParameterShardPlan, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    buffers = [plan.flatten(tensors, server) for server in range(plan.num_servers)]
    restored = {name: torch.zeros_like(t) for name, t in tensors.items()}
    for server, buffer in enumerate(buffers):
        assert buffer.shape == (plan.server_numel(server),)
        plan.unflatten_into(buffer, server, restored)
    return restored


def _covered_exactly_once(plan: ParameterShardPlan, tensors: dict[str, torch.Tensor]) -> None:
    """Flatten a tensor of ones per server and sum back: every element must count exactly once."""
    counts = {name: torch.zeros(t.shape) for name, t in tensors.items()}
    for server in range(plan.num_servers):
        ones = plan.flatten({n: torch.ones_like(t) for n, t in tensors.items()}, server)
        scratch = {n: torch.zeros(t.shape) for n, t in tensors.items()}
        plan.unflatten_into(ones, server, scratch)
        for name in counts:
            counts[name] += scratch[name]
    for name, count in counts.items():
        assert torch.equal(count, torch.ones(tensors[name].shape)), name


@pytest.mark.parametrize("num_servers", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("model", ["mlp", "mixed"])
def test_flatten_then_unflatten_restores_every_element_exactly_once(model, num_servers):
    tensors = {n: p.detach().clone() for n, p in _mlp().named_parameters()} if model == "mlp" else _mixed()
    plan = plan_shards(tensors, num_servers, min_shard_bytes=4 * KIB)
    assert sum(plan.server_numel(s) for s in range(num_servers)) == sum(t.numel() for t in tensors.values())
    restored = _roundtrip(plan, tensors)
    for name, tensor in tensors.items():
        assert torch.equal(restored[name], tensor), name
    _covered_exactly_once(plan, tensors)


def test_flatten_works_on_parameters_with_grad_and_on_gradients():
    model = _mlp()
    model(torch.randn(4, 64)).sum().backward()
    plan = plan_shards(model.named_parameters(), 3, min_shard_bytes=16 * KIB)
    params = dict(model.named_parameters())
    grads = {n: p.grad for n, p in params.items()}
    for server in range(3):
        flat_params, flat_grads = plan.flatten(params, server), plan.flatten(grads, server)
        assert not flat_params.requires_grad and flat_params.dtype == torch.float32
        assert flat_grads.numel() == flat_params.numel() == plan.server_numel(server)
    # Writing a buffer into the live parameters needs no torch.no_grad() by the caller and leaves no graph.
    before = params["0.weight"].detach().clone()
    for server in range(3):
        plan.unflatten_into(plan.flatten(params, server) * 2, server, params)
    assert torch.equal(params["0.weight"].detach(), before * 2)
    assert params["0.weight"].grad_fn is None


def test_flatten_keeps_the_dtype_and_refuses_mixed_dtypes_on_one_server():
    half = {"a": torch.randn(8, 4, dtype=torch.bfloat16), "b": torch.randn(3, dtype=torch.bfloat16)}
    plan = plan_shards(half, 1)
    assert plan.flatten(half, 0).dtype == torch.bfloat16
    mixed = {"a": torch.randn(8, 4), "b": torch.randn(3, dtype=torch.float16)}
    with pytest.raises(TypeError, match=r"mix dtypes.*Cast the tensors to one dtype"):
        plan_shards(mixed, 1).flatten(mixed, 0)


def test_large_tensors_are_split_into_row_blocks_on_distinct_servers():
    params = {"big": torch.empty(1000, 64), "small": torch.empty(10, 64)}  # 256000 bytes and 2560 bytes
    plan = plan_shards(params, 4, min_shard_bytes=32 * KIB)
    big = [s for s in plan.slices if s.name == "big"]
    assert [s.rows for s in big] == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert sorted(s.server for s in big) == [0, 1, 2, 3]
    assert all(s.shape == (250, 64) and s.numel == 250 * 64 for s in big)
    assert [s.rows for s in plan.slices if s.name == "small"] == [(0, 10)]


def test_number_of_blocks_follows_min_size_partitioner():
    # 100 rows of 1 KiB each = 100 KiB.
    params = {"w": torch.empty(100, 256)}

    def blocks(**kwargs) -> list[tuple[int, int]]:
        return [s.rows for s in plan_shards(params, **kwargs).slices]

    # size // min_shard_bytes = 3 caps the blocks below num_servers; remainder rows go to the first blocks.
    assert blocks(num_servers=8, min_shard_bytes=30 * KIB) == [(0, 34), (34, 67), (67, 100)]
    # num_servers caps them.
    assert len(blocks(num_servers=2, min_shard_bytes=KIB)) == 2
    # max_shards_per_tensor caps them.
    assert len(blocks(num_servers=8, min_shard_bytes=KIB, max_shards_per_tensor=5)) == 5
    # Below 2 * min_shard_bytes the tensor stays whole.
    assert blocks(num_servers=8, min_shard_bytes=51 * KIB) == [(0, 100)]
    # Exactly 2 * min_shard_bytes splits in two.
    assert len(blocks(num_servers=8, min_shard_bytes=50 * KIB)) == 2
    # The rows bound the blocks.
    assert len(plan_shards({"w": torch.empty(3, 100_000)}, 8, min_shard_bytes=KIB).slices) == 3


def test_every_block_keeps_at_least_min_shard_bytes():
    # 3 rows of 100 bytes, min 140: size // min = 2, but 2 blocks would leave one of 100 bytes, so it stays whole.
    assert [s.rows for s in plan_shards({"w": torch.empty(3, 25)}, 4, min_shard_bytes=140).slices] == [(0, 3)]
    rng = random.Random(0)
    for _ in range(200):
        rows, cols, minimum = rng.randint(2, 60), rng.randint(1, 40), rng.randint(4, 2000)
        for s in plan_shards({"w": torch.empty(rows, cols)}, rng.randint(1, 9), min_shard_bytes=minimum).slices:
            if s.rows != (0, rows):
                assert s.numel * 4 >= minimum, (rows, cols, minimum, s)


def test_small_one_row_and_scalar_tensors_are_never_split():
    params = _mixed()
    plan = plan_shards(params, 4, min_shard_bytes=1)
    pieces = Counter(s.name for s in plan.slices)
    assert pieces["row.weight"] == 1 and pieces["scale"] == 1 and pieces["empty"] == 1
    assert pieces["emb.weight"] == 4
    scalar = next(s for s in plan.slices if s.name == "scale")
    assert scalar.rows == (0, 1) and scalar.shape == () and scalar.numel == 1
    row = next(s for s in plan.slices if s.name == "row.weight")
    assert row.rows == (0, 1) and row.shape == (1, 3000)
    default = plan_shards(params, 4)  # 256 KiB default: every tensor here is smaller than 512 KiB
    assert len(default.slices) == len(params)


def test_equal_tensors_balance_to_within_one_tensor():
    for count, servers in [(10, 3), (16, 4), (7, 7), (5, 8), (33, 6)]:
        params = [(f"layer{i}.weight", torch.empty(32, 32)) for i in range(count)]
        loads = plan_shards(params, servers).bytes_per_server()
        assert max(loads) - min(loads) <= 32 * 32 * 4, (count, servers, loads)
        assert sum(loads) == count * 32 * 32 * 4


def test_a_mix_of_sizes_stays_within_the_list_scheduling_bound():
    rng = random.Random(1234)
    for trial in range(100):
        servers = rng.randint(2, 9)
        params = [(f"p{i}", torch.empty(rng.randint(1, 300), rng.randint(1, 64))) for i in range(rng.randint(1, 40))]
        plan = plan_shards(params, servers, min_shard_bytes=rng.choice([256, 4 * KIB, 32 * KIB]))
        loads = plan.bytes_per_server(element_size=4)
        largest = max(s.numel for s in plan.slices) * 4
        assert max(loads) - min(loads) <= largest, trial
        assert max(loads) <= sum(loads) / servers + (1 - 1 / servers) * largest, trial


def test_pieces_are_placed_largest_first():
    # Placing in parameter order would give [1+1+4, 1+1] = [6, 2]; largest first gives [4, 1+1+1+1].
    plan = plan_shards([(f"p{i}", torch.empty(n)) for i, n in enumerate([1, 1, 1, 1, 4])], 2)
    assert [s.server for s in plan.slices] == [1, 1, 1, 1, 0]
    assert plan.bytes_per_server(element_size=1) == [4, 4]
    # Exact LPT placement with ties to the lowest index: 3->s0, 3->s1, 2->s0, 2->s1, 2->s0.
    plan = plan_shards([(f"p{i}", torch.empty(n)) for i, n in enumerate([2, 3, 2, 3, 2])], 2)
    assert [s.server for s in plan.slices] == [0, 0, 1, 1, 0]
    assert plan.bytes_per_server(element_size=1) == [7, 5]


def test_one_server_holds_everything_in_parameter_order():
    model = _mlp()
    plan = plan_shards(model.named_parameters(), 1, min_shard_bytes=1)
    names = [n for n, _ in model.named_parameters()]
    assert [s.name for s in plan.server_slices(0)] == names
    assert all(s.server == 0 for s in plan.slices)
    params = dict(model.named_parameters())
    expected = torch.cat([p.detach().reshape(-1) for p in params.values()])
    assert torch.equal(plan.flatten(params, 0), expected)


def test_offsets_follow_parameter_then_row_order_within_each_server():
    plan = plan_shards(_mixed(), 3, min_shard_bytes=KIB)
    order = {name: i for i, name in enumerate(_mixed())}
    for server in range(3):
        pieces = plan.server_slices(server)
        keys = [(order[s.name], s.rows[0]) for s in pieces]
        assert keys == sorted(keys)
        assert [s.offset for s in pieces] == [sum(p.numel for p in pieces[:i]) for i in range(len(pieces))]


def test_ties_go_to_the_lowest_server_index():
    plan = plan_shards([("a", torch.empty(4)), ("b", torch.empty(4)), ("c", torch.empty(4))], 5)
    assert [s.server for s in plan.slices] == [0, 1, 2]
    assert plan.bytes_per_server() == [16, 16, 16, 0, 0]
    assert plan.flatten({"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(4)}, 4).shape == (0,)


def test_plans_are_deterministic_and_the_same_for_dict_list_and_generator_inputs():
    model = _mlp()
    pairs = [(n, p) for n, p in model.named_parameters()]
    plans = [
        plan_shards(pairs, 3, min_shard_bytes=16 * KIB),
        plan_shards(dict(pairs), 3, min_shard_bytes=16 * KIB),
        plan_shards(model.named_parameters(), 3, min_shard_bytes=16 * KIB),
        plan_shards([(n, torch.empty(p.shape, device="meta")) for n, p in pairs], 3, min_shard_bytes=16 * KIB),
    ]
    assert all(plan == plans[0] for plan in plans)
    assert len({plan.fingerprint() for plan in plans}) == 1
    assert len(plans[0].slices) > len(pairs)  # something was split, so the comparison covers splitting
    # The dtype matters (it sets the split threshold): fp16 halves the bytes, so fewer tensors are split.
    half = plan_shards([(n, p.half()) for n, p in pairs], 3, min_shard_bytes=16 * KIB)
    assert len(half.slices) < len(plans[0].slices)


def test_fingerprint_is_stable_and_changes_with_a_shape_or_a_name():
    base = [("a.weight", torch.empty(64, 32)), ("a.bias", torch.empty(64))]
    fingerprint = plan_shards(base, 2).fingerprint()
    assert fingerprint == plan_shards(list(base), 2).fingerprint()
    assert 0 <= fingerprint < 2**63
    assert plan_shards([("a.weight", torch.empty(64, 33)), base[1]], 2).fingerprint() != fingerprint
    assert plan_shards([("b.weight", torch.empty(64, 32)), base[1]], 2).fingerprint() != fingerprint
    assert plan_shards(base, 3).fingerprint() != fingerprint
    # Pinned value: BLAKE2b of the int64 encoding, independent of Python's hash seed and of the process.
    assert plan_shards([("w", torch.empty(2, 2))], 1).fingerprint() == _pinned_fingerprint()


def _pinned_fingerprint() -> int:
    import hashlib
    import struct

    values = [0x5053504C414E, 1, 1, 1, 0, 0, 2, 0, 4, 2, 2, 2, 1, ord("w")]
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def test_tensor_encoding_round_trips():
    plan = plan_shards({**_mixed(), "ünï.weight": torch.empty(3, 3)}, 3, min_shard_bytes=KIB)
    encoded = plan.to_tensor()
    assert encoded.dtype == torch.int64 and encoded.dim() == 1
    decoded = ParameterShardPlan.from_tensor(encoded)
    assert decoded == plan and decoded.fingerprint() == plan.fingerprint()
    assert decoded.server_slices(1) == plan.server_slices(1)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        ParameterShardPlan.from_tensor(encoded[:-3])
    with pytest.raises(ValueError, match="not a ParameterShardPlan encoding"):
        ParameterShardPlan.from_tensor(torch.arange(10))
    with pytest.raises(ValueError, match="1-D int64"):
        ParameterShardPlan.from_tensor(encoded.float())


def test_plan_constructor_rejects_inconsistent_slices():
    good = ShardSlice("w", 0, (0, 2), (2, 3), 0, 6)
    assert ParameterShardPlan(1, (good,)).server_numel(0) == 6
    with pytest.raises(ValueError, match="sits on server 1 but the plan has 1 servers"):
        ParameterShardPlan(1, (ShardSlice("w", 1, (0, 2), (2, 3), 0, 6),))
    with pytest.raises(ValueError, match="offsets must be contiguous"):
        ParameterShardPlan(1, (ShardSlice("w", 0, (0, 2), (2, 3), 5, 6),))
    with pytest.raises(ValueError, match="overlapping row blocks"):
        ParameterShardPlan(2, (good, ShardSlice("w", 1, (1, 2), (1, 3), 0, 3)))


def test_flatten_and_unflatten_reject_tensors_of_another_model():
    plan = plan_shards({"w": torch.empty(4, 3)}, 1)
    with pytest.raises(ValueError, match=r"'w' has shape \(4, 4\).*Rebuild it with plan_shards"):
        plan.flatten({"w": torch.empty(4, 4)}, 0)
    with pytest.raises(KeyError, match="lack it"):
        plan.flatten({"v": torch.empty(4, 3)}, 0)
    with pytest.raises(TypeError, match="zeros_like"):
        plan.flatten({"w": None}, 0)
    with pytest.raises(ValueError, match=r"1-D with 12 elements, got shape \(11,\)"):
        plan.unflatten_into(torch.empty(11), 0, {"w": torch.empty(4, 3)})
    with pytest.raises(ValueError, match=r"server=1 is out of range.*pass 0..0"):
        plan.flatten({"w": torch.empty(4, 3)}, 1)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: plan_shards({"w": torch.empty(2)}, 0), ValueError, r"num_servers must be a positive integer, got 0"),
        (lambda: plan_shards({"w": torch.empty(2)}, True), ValueError, r"num_servers .* got True"),
        (lambda: plan_shards({}, 2), ValueError, "(?i)the model has no trainable parameters"),
        (lambda: plan_shards(nn.ReLU().named_parameters(), 2), ValueError, "no trainable parameters"),
        (
            lambda: plan_shards([("w", torch.empty(2)), ("b", torch.empty(1)), ("w", torch.empty(3))], 2),
            ValueError,
            r"Duplicate parameter names \['w'\]",
        ),
        (
            lambda: plan_shards({"ids": torch.zeros(3, dtype=torch.int64)}, 2),
            TypeError,
            r"'ids' has dtype torch.int64; only floating-point.*register_buffer",
        ),
        (lambda: plan_shards({"w": torch.empty(2)}, 2, min_shard_bytes=0), ValueError, "min_shard_bytes must be"),
        (
            lambda: plan_shards({"w": torch.empty(2)}, 2, max_shards_per_tensor=0),
            ValueError,
            "max_shards_per_tensor must be",
        ),
        (lambda: plan_shards([("w", [1.0, 2.0])], 2), TypeError, "'w' is a list, not a torch.Tensor"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(call, error, message):
    with pytest.raises(error, match=message):
        call()
