"""``LayerSplitStrategy(device_map=...)``: the planner, the map's rules, the option's checks, and training parity.

On the CPU every "device" is ``cpu``, so parity alone would also pass if nothing were placed; each parity test also
asserts that every placed module's hooks ran once per step and that the hooks' device move was called (the control
that fails when placement is skipped). The pure parts (planner, units, resolve) are given CUDA devices by name: they
move nothing, so they run on any machine.
"""

from __future__ import annotations

import itertools
import random

import lightning.pytorch as pl
import pytest
import torch
from jsonargparse import ArgumentParser
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader

import ds_lightning.device_map.engine as engine_module
import ds_lightning.device_map.hooks as hooks_module
from ds_lightning.device_map import auto_map, auto_units, plan, resolve
from ds_lightning.strategies.layer_split import LayerSplitStrategy
from tests.helpers.controls import assert_far
from tests.helpers.device_map_runs import STEPS, build, byte_batches, fit

TOL = {"atol": 1e-5, "rtol": 1e-5}
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
TIED_MAP = {"token": "cpu", "position": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "norm": "cpu", "head": "cpu"}


def _loads(sizes: list[int], slots: list[int], n: int) -> list[int]:
    return [sum(s for s, slot in zip(sizes, slots, strict=True) if slot == d) for d in range(n)]


# --- the planner (pure) --------------------------------------------------------------------------------------------


def test_balanced_plan_splits_bytes_in_proportion_to_free_memory():
    sizes = [10] * 8
    assert plan(sizes, [100, 100]) == [0] * 4 + [1] * 4
    assert plan(sizes, [300, 100]) == [0] * 6 + [1] * 2
    assert plan(sizes, [100, 100], base=[20, 0]) == [0] * 3 + [1] * 5  # the root's own bytes count on slot 0
    # Control: without balancing the first device takes everything that fits, like accelerate's sequential fill.
    unbalanced = plan(sizes, [100, 100], balanced=False)
    assert unbalanced == [0] * 8
    assert _loads(sizes, unbalanced, 2) == [80, 0]


def test_balanced_plan_is_the_best_contiguous_split():
    rng = random.Random(0)
    for _ in range(40):
        n, k = rng.randint(1, 7), rng.randint(1, 3)
        sizes = [rng.randint(0, 50) for _ in range(n)]
        free = [rng.randint(60, 200) for _ in range(k)]

        def worst(slots, sizes=sizes, free=free, k=k):
            return max(load / f for load, f in zip(_loads(sizes, slots, k), free, strict=True))

        candidates = [s for s in itertools.product(range(k), repeat=n) if list(s) == sorted(s) and worst(s) <= 1.0]
        if not candidates:
            with pytest.raises(ValueError, match="cannot place"):
                plan(sizes, free)
            continue
        got = plan(sizes, free)
        assert got == sorted(got)
        assert worst(got) == pytest.approx(min(worst(s) for s in candidates)), (sizes, free, got)


def test_plan_that_does_not_fit_names_the_bytes_and_the_fix():
    with pytest.raises(ValueError, match=r"cannot place 300 bytes.*\[100, 100\] free bytes.*explicit device_map"):
        plan([150, 150], [100, 100])
    with pytest.raises(ValueError, match="cannot place"):
        plan([50, 50], [100, 100], base=[100, 10], balanced=False)


# --- units and "auto" (pure: devices are only names here) ----------------------------------------------------------


def test_auto_map_keeps_tied_embedding_and_head_together_and_balances_tiedgpt():
    net = build("tied_gpt").net
    groups, pinned, root_bytes = auto_units(net, 2)
    assert [g.names for g in groups] == [("token", "head"), ("position",), ("blocks.0",), ("blocks.1",), ("norm",)]
    assert pinned == [] and root_bytes == 0
    assert groups[0].nbytes == 256 * 32 * 4  # the tied weight counted once
    mapping = auto_map(net, [CUDA0, CUDA1], [10**9, 10**9])
    assert mapping["token"] == mapping["head"] == CUDA0
    assert mapping["blocks.1"] == mapping["norm"] == CUDA1
    loads = {d: sum(g.nbytes for g in groups if mapping[g.names[0]] == d) for d in (CUDA0, CUDA1)}
    # Control: the sequential fill leaves cuda:1 empty; balancing keeps the two within one block's bytes.
    sequential = auto_map(net, [CUDA0, CUDA1], [10**9, 10**9], balanced=False)
    assert set(sequential.values()) == {CUDA0}
    assert abs(loads[CUDA0] - loads[CUDA1]) <= groups[2].nbytes


def test_auto_map_opens_a_wrapper_larger_than_a_share_hf_gpt2():
    net = build("hf_gpt2").net
    groups, pinned, _ = auto_units(net, 2)
    assert pinned == []
    names = [g.names for g in groups]
    # GPT2LMHeadModel.transformer holds nearly everything: it is opened, its blocks (h.N) stay whole.
    assert names[0] == ("transformer.wte", "lm_head")
    assert ("transformer.h.0",) in names and ("transformer.h.1",) in names
    assert all(not any(n.startswith("transformer.h.0.") for n in g) for g in names)
    mapping = auto_map(net, [CUDA0, CUDA1], [10**9, 10**9])
    assert mapping["transformer.wte"] == mapping["lm_head"]
    assert set(mapping.values()) == {CUDA0, CUDA1}


class _RootTied(nn.Module):
    """The root owns a weight that a child also uses: the child must stay on the root device."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))
        self.first = nn.Linear(64, 64)
        self.second = nn.Linear(64, 64)
        self.user = nn.Module()
        self.user.scale = self.scale


def test_a_unit_sharing_the_roots_own_weight_is_pinned_to_the_root():
    net = _RootTied()
    groups, pinned, root_bytes = auto_units(net, 2)
    assert [g.names for g in pinned] == [("user",)]
    assert [g.names for g in groups] == [("first",), ("second",)]
    assert root_bytes == 64 * 4
    mapping = auto_map(net, [CUDA0, CUDA1], [10**9] * 2)
    assert mapping == {"user": CUDA0, "first": CUDA0, "second": CUDA1}
    resolve(net, mapping, CUDA0)  # consistent: the tie is not split


def test_auto_map_with_too_little_memory_fails_naming_the_bytes():
    with pytest.raises(ValueError, match="cannot place"):
        auto_map(build("tied_gpt").net, [CUDA0, CUDA1], [1000, 1000])


# --- resolving an explicit map (pure) ------------------------------------------------------------------------------


def test_unlisted_tensors_go_with_their_listed_parent_else_the_root():
    net = build("tied_gpt").net
    placement = resolve(net, {"blocks.1": CUDA1, "token": CUDA0, "head": CUDA0}, CUDA0)
    where = {}
    for module, attr, _, device in placement.tensors:
        name = next(n for n, m in net.named_modules() if m is module)
        where[f"{name}.{attr}"] = device
    assert where["blocks.1.attn.qkv.weight"] == CUDA1  # inside a listed module
    assert where["blocks.0.attn.qkv.weight"] == CUDA0  # unlisted: the root device
    assert where["norm.weight"] == CUDA0
    assert placement.modules == {"": CUDA0, "blocks.1": CUDA1, "token": CUDA0, "head": CUDA0}


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"blocks.7": CUDA1}, r"'blocks.7', which is not a submodule.*Did you mean.*'blocks.0'"),
        ({"norm.weight": CUDA1}, r"'norm.weight', a parameter .*place 'norm' instead"),
        ({"blocks": CUDA1, "blocks.0": CUDA0}, r"both 'blocks' and 'blocks.0'.*drop 'blocks'"),
        ({"token": CUDA0, "head": CUDA1}, r"`token.weight` and `head.weight` are one tensor .*same device"),
        ({"head": CUDA1}, r"`token.weight` and `head.weight` are one tensor"),  # token unlisted: the root device
    ],
    ids=["unknown", "parameter", "overlap", "tied-split", "tied-unlisted"],
)
def test_ambiguous_maps_are_refused_naming_the_name_and_the_fix(mapping, message):
    with pytest.raises(ValueError, match=message):
        resolve(build("tied_gpt").net, mapping, CUDA0)


def test_one_module_under_two_names_is_refused():
    net = build("tied_gpt").net
    net.alias = net.norm
    with pytest.raises(ValueError, match="one module object; list it once"):
        resolve(net, {"norm": CUDA1, "alias": CUDA1}, CUDA0)
    # Control: listed once, the alias follows it, so nothing is split.
    resolve(net, {"norm": CUDA1}, CUDA0)


# --- the option, at construction -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device_map": "balanced"}, r"device_map='balanced' must be None, 'auto' or a dict"),
        ({"device_map": {}}, r"device_map=\{\} places nothing"),
        ({"device_map": {"": "cpu"}}, r"key '' names the whole pipelined module"),
        ({"device_map": {"blocks..0": "cpu"}}, r"'blocks..0' is not a dotted submodule name"),
        ({"device_map": {"head": "disk"}}, r"device_map\['head'\]='disk' is not a torch device.*Offload"),
        ({"device_map": {"head": "meta"}}, r"the meta device holds no data"),
        ({"device_map": {"head": "cuda"}}, r"'cuda' has no index"),
        ({"device_map": {"head": True}}, r"device_map\['head'\]=True must be a device string"),
        ({"device_map": {"head": -1}}, r"a GPU index is >= 0"),
        ({"device_map": {"head": "cpu", "norm": "cuda:0"}}, r"mixes device types"),
        ({"device_map": "auto", "n_microbatches": 4}, r"n_microbatches=4\): n_microbatches applies to the"),
        ({"device_map": "auto", "balance": [1, 1]}, r"balance=\[1, 1\]\).*drop balance"),
        ({"device_map": "auto", "activation_checkpointing": True}, r"drop activation_checkpointing"),
        ({"device_map": {"head": "cuda:2"}, "devices": ["cuda:0", "cuda:1"]}, r"uses \['cuda:2'\], not in devices"),
    ],
)
def test_bad_device_maps_fail_at_construction_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerSplitStrategy(**kwargs)


def test_a_maps_own_devices_are_the_default_and_construction_touches_no_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("__init__ queried CUDA"))
    strategy = LayerSplitStrategy(device_map={"blocks.1": 1, "token": "cuda:0", "head": "cuda:0"})
    assert strategy.stage_devices == [CUDA0, CUDA1]
    assert strategy.root_device == CUDA0
    assert strategy.device_map == {"blocks.1": CUDA1, "token": CUDA0, "head": CUDA0}
    # Control: without device_map the Sequential path's options are untouched.
    assert LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=4).device_map is None


@pytest.mark.parametrize(
    ("yaml", "expected"),
    [
        ("device_map: auto", "auto"),
        ("device_map: {blocks.1: 'cuda:1', token: 0}", {"blocks.1": CUDA1, "token": CUDA0}),
        ("device_map: null", None),
    ],
)
def test_jsonargparse_builds_device_map_from_yaml(yaml, expected):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(LayerSplitStrategy, "strategy")
    config = parser.parse_string(f"strategy:\n  devices: ['cuda:0', 'cuda:1']\n  {yaml}\n")
    strategy = parser.instantiate_classes(config).strategy
    assert strategy.device_map == expected


# --- training parity on the CPU ------------------------------------------------------------------------------------


@pytest.fixture
def moves(monkeypatch):
    """Every device the hooks' move function was asked for (the control that placement ran)."""
    targets: list[torch.device] = []
    real = hooks_module.move_to

    def counting(data, device):
        targets.append(device)
        return real(data, device)

    monkeypatch.setattr(hooks_module, "move_to", counting)
    return targets


def _assert_parity(run, reference):
    assert len(run.losses) == len(reference.losses) == STEPS
    assert_close(torch.stack(run.losses), torch.stack(reference.losses), **TOL)
    for name, value in run.final.items():
        assert_close(value, reference.final[name], **TOL, msg=name)
    # Control: training moved the weights far beyond the tolerance, so parity is not two idle runs agreeing.
    assert_far(run.final, run.initial, 1e-3, "the weights before training")


def test_tied_gpt_with_an_explicit_map_trains_like_the_unsplit_model(moves):
    reference = fit("tied_gpt")
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], device_map=TIED_MAP)
    run = fit("tied_gpt", strategy)
    _assert_parity(run, reference)
    # The hooks ran: every placed module once per step, and the pipelined module itself ("").
    assert strategy.device_hook_calls == dict.fromkeys(["", *TIED_MAP], STEPS)
    assert len(moves) == 3 * STEPS * (len(TIED_MAP) + 1)  # args and kwargs in, outputs out
    assert run.model.net.head.weight is run.model.net.token.weight  # still one Parameter
    assert run.loss_devices == {"cpu"}


def test_tied_gpt_auto_over_two_slots_trains_like_the_unsplit_model(monkeypatch, moves):
    monkeypatch.setattr(engine_module, "free_bytes", lambda devices: [10**9] * len(devices))
    planned: list[dict] = []
    real = engine_module.auto_map
    monkeypatch.setattr(engine_module, "auto_map", lambda *a, **k: planned.append(real(*a, **k)) or planned[-1])
    reference = fit("tied_gpt")
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], device_map="auto")
    run = fit("tied_gpt", strategy)
    _assert_parity(run, reference)
    assert set(strategy.device_map_used) == {"token", "head", "position", "blocks.0", "blocks.1", "norm"}
    assert strategy.device_hook_calls == dict.fromkeys(["", *strategy.device_map_used], STEPS)
    assert moves
    # The plan used both slots (both "cpu" here): checked on the planner's own output with distinct names.
    assert auto_map(run.model.net, [CUDA0, CUDA1], [10**9] * 2)["norm"] == CUDA1


def test_hf_gpt2_auto_trains_like_the_unsplit_model(monkeypatch, moves):
    monkeypatch.setattr(engine_module, "free_bytes", lambda devices: [10**9] * len(devices))
    reference = fit("hf_gpt2")
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], device_map="auto")
    run = fit("hf_gpt2", strategy)
    _assert_parity(run, reference)
    assert "transformer.h.1" in strategy.device_map_used
    assert strategy.device_hook_calls["transformer.h.1"] == STEPS
    assert strategy.device_hook_calls["lm_head"] == STEPS
    assert moves


def test_after_fit_the_hooks_are_gone_and_validate_places_again(tmp_path):
    strategy = LayerSplitStrategy(devices=["cpu"], device_map={"blocks.1": "cpu"})
    model = build("tied_gpt")
    trainer = pl.Trainer(
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(byte_batches(8), batch_size=8))
    assert strategy.device_hook_calls == {"": 1, "blocks.1": 1}
    model.net(torch.zeros(2, 4, dtype=torch.long))
    assert strategy.device_hook_calls == {"": 1, "blocks.1": 1}  # the plain call after fit ran no hook
    trainer.validate(model, DataLoader(byte_batches(16), batch_size=8), verbose=False)
    assert strategy.device_hook_calls == {"": 2, "blocks.1": 2}  # placed again: counts restart, two batches


def test_a_checkpoint_written_while_placed_resumes_like_an_uninterrupted_plain_run(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.controls import without_optimizer_state

    # One batch per epoch: Lightning's resume of a plain DataLoader may not pick the same next batch, one batch can.
    reference = fit("tied_gpt", steps=4, batches=1)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="epoch0", save_top_k=-1)
    first = fit(
        "tied_gpt", LayerSplitStrategy(devices=["cpu", "cpu"], device_map="auto"), steps=2, batches=1, callbacks=[saver]
    )
    path = tmp_path / "epoch0.ckpt"
    saved = torch.load(path, weights_only=True)
    assert saved["global_step"] == 2
    assert list(saved["state_dict"]) == list(first.final)  # the plain module's keys: nothing is wrapped
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], device_map="auto")
    resumed = fit("tied_gpt", strategy, steps=4, batches=1, ckpt_path=str(path))
    assert strategy.device_hook_calls["blocks.1"] == 2  # the two steps after the resume ran placed
    for name, value in resumed.final.items():
        assert_close(value, reference.final[name], **TOL, msg=name)
    # Control: the same resume without the optimizer's state (AdamW moments) ends far from the reference.
    lost = without_optimizer_state(path, tmp_path / "lost.ckpt")
    control = fit(
        "tied_gpt", LayerSplitStrategy(devices=["cpu"], device_map="auto"), steps=4, batches=1, ckpt_path=str(lost)
    )
    assert_far(control.final, reference.final, 1e-4, "a resume without optimizer state")


def test_an_unknown_name_fails_at_setup_naming_it():
    strategy = LayerSplitStrategy(devices=["cpu"], device_map={"blocks.9": "cpu"})
    with pytest.raises(ValueError, match=r"'blocks.9', which is not a submodule of `TiedTransformer`"):
        fit("tied_gpt", strategy, steps=1)


def test_a_missing_pipe_module_names_the_option():
    strategy = LayerSplitStrategy(devices=["cpu"], device_map="auto", pipe_module="body")
    with pytest.raises(AttributeError, match=r"`TiedGPT.body`.*pipe_module"):
        fit("tied_gpt", strategy, steps=1)


class _Residual(nn.Module):
    """A forward that mixes a child's output with its own input: needs the outputs back on the caller's device."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.inner(x)


def test_outputs_return_to_the_callers_device(moves):
    from ds_lightning.device_map import place

    net = _Residual()
    hooks, _ = place(net, {"inner": torch.device("cpu")}, [torch.device("cpu")])
    net(torch.ones(2, 4))
    # The root's args and kwargs in, `inner`'s in, `inner`'s output back, the root's output back.
    assert [str(d) for d in moves] == ["cpu"] * 6
    hooks.detach()
    moves.clear()
    net(torch.ones(2, 4))
    assert moves == []  # control: detached, nothing moves


# --- two virtual GPUs on the CPU: where activations meet -----------------------------------------------------------


def _loss_and_grads(model, x, y):
    model.zero_grad()
    loss = model.pipeline_loss(model.net(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        ("tied_gpt", "auto"),
        # The embedding sum meets across devices (token on cuda:0, position on cuda:1), and so does the residual
        # inside blocks.1 (its attention on cuda:1, its block on the root).
        ("tied_gpt", {"token": CUDA0, "head": CUDA0, "position": CUDA1, "blocks.0": CUDA1, "blocks.1.attn": CUDA1}),
        ("hf_gpt2", "auto"),
    ],
    ids=["tied-gpt-auto", "tied-gpt-crossing", "hf-gpt2-auto"],
)
def test_on_two_virtual_gpus_no_op_mixes_devices_and_gradients_match(monkeypatch, kind, layout):
    from tests.helpers.device_map_runs import BLOCK
    from tests.helpers.virtual_devices import virtual_place

    model = build(kind)
    x, y = byte_batches(4)[:]
    reference_loss, reference_grads = _loss_and_grads(model, x, y)
    mapping = auto_map(model.net, [CUDA0, CUDA1], [10**9] * 2) if layout == "auto" else layout
    assert set(mapping.values()) == {CUDA0, CUDA1}
    with virtual_place(model.net, mapping, CUDA0, monkeypatch) as mode:
        mode.tag(x, CUDA0)
        output = model.net(x)
        logits = output if isinstance(output, torch.Tensor) else output.logits
        assert mode.device_of(logits) == CUDA0  # back on the root device for training_step
        assert logits.shape == (4, BLOCK, 256)
        loss, grads = _loss_and_grads(model, x, y)  # forward checked op by op, backward through the hooks' moves
    assert_close(loss, reference_loss, **TOL)
    for name, grad in grads.items():
        assert_close(grad, reference_grads[name], **TOL, msg=name)


def test_virtual_gpus_catch_mixing_when_the_hooks_are_off(monkeypatch):
    """Control: the same placement with the tensors tagged but no hooks fails at the first cross-device op."""
    from tests.helpers.virtual_devices import virtual_place

    model = build("tied_gpt")
    x, _ = byte_batches(4)[:]
    mapping = {"token": CUDA0, "head": CUDA0, "position": CUDA1, "blocks.0": CUDA1}
    with (
        virtual_place(model.net, mapping, CUDA0, monkeypatch, hooks=False) as mode,
        pytest.raises(RuntimeError, match=r"virtual devices mixed .*\['cuda:0', 'cuda:1'\]"),
    ):
        mode.tag(x, CUDA0)
        model.net(x)


def test_leaving_outputs_on_the_childs_device_would_break_the_embedding_sum(monkeypatch):
    """Why the hooks return outputs to the caller: without that (accelerate's inner modules), TiedGPT's
    ``token(x) + position(p)`` adds tensors of two devices. The same map passes in the crossing case above."""
    from tests.helpers.virtual_devices import virtual_place

    attach_hooks = hooks_module.DeviceHooks._hook

    def without_return(self, name, module, device):
        attach_hooks(self, name, module, device)
        self._handles.pop().remove()  # the forward hook that moves outputs back

    monkeypatch.setattr(hooks_module.DeviceHooks, "_hook", without_return)
    model = build("tied_gpt")
    x, _ = byte_batches(4)[:]
    mapping = {"token": CUDA0, "head": CUDA0, "position": CUDA1, "blocks.0": CUDA1, "blocks.1.attn": CUDA1}
    with (
        virtual_place(model.net, mapping, CUDA0, monkeypatch) as mode,
        pytest.raises(RuntimeError, match=r"virtual devices mixed in add"),
    ):
        mode.tag(x, CUDA0)
        model.net(x)
