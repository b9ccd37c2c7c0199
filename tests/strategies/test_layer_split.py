"""ds_model_parallel in one process: parity with plain training, GPipe order, balance, checkpoints, errors."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from ds_lightning.pipeline.clock import clock_cycles
from ds_lightning.pipeline.microbatch import MicroBatchedSequential
from ds_lightning.strategies.layer_split import LayerSplitStrategy
from tests.helpers.controls import assert_far, without_optimizer_state

TOL = {"atol": 1e-5, "rtol": 1e-5}
BATCH = 16


class PipeMLP(pl.LightningModule):
    """``self.net`` is split; ``self.head`` stays whole on the root device. Losses of every step are recorded."""

    def __init__(self, seed: int = 0, lr: float = 0.1, momentum: float = 0.9, example: bool = True) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.net = nn.Sequential(
                nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh()
            )
            self.head = nn.Linear(16, 3)
        self.lr, self.momentum = lr, momentum
        self.example_input_array = torch.zeros(4, 8) if example else None
        self.losses: list[torch.Tensor] = []

    def forward(self, x):
        return self.head(self.net(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.detach().cpu())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def _data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loader(n: int = 48) -> DataLoader:
    return DataLoader(TensorDataset(*_data(n)), batch_size=BATCH, shuffle=False)


def _trainer(strategy: LayerSplitStrategy | None = None, **kwargs) -> pl.Trainer:
    args = {
        "accelerator": "cpu",
        "max_steps": 5,
        "enable_progress_bar": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    args.update(kwargs)
    if strategy is None:
        args["devices"] = 1
    else:
        args["strategy"] = strategy
    return pl.Trainer(**args)


def _plain_run(steps: int = 5) -> PipeMLP:
    model = PipeMLP()
    _trainer(max_steps=steps).fit(model, _loader())
    return model


class _CountCalls:
    """Forward pre-hook that records the rows each call of a layer receives."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, module, args):
        self.rows.append(args[0].shape[0])


# --- the schedule and parity with a plain Trainer ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "n_microbatches", "balance", "checkpointing", "expected_balance", "chunk_rows"),
    [
        (["cpu", "cpu"], 4, None, False, [3, 3], [4, 4, 4, 4]),
        (["cpu", "cpu"], 4, None, True, [3, 3], [4, 4, 4, 4]),
        (["cpu", "cpu"], 4, [1, 5], False, [1, 5], [4, 4, 4, 4]),
        (["cpu", "cpu", "cpu"], 3, [2, 3, 1], True, [2, 3, 1], [6, 5, 5]),
    ],
    ids=["microbatched", "activation-checkpointing", "explicit-balance", "3-stages-uneven-chunks"],
)
def test_training_matches_a_plain_trainer(
    devices, n_microbatches, balance, checkpointing, expected_balance, chunk_rows
):
    reference = _plain_run()
    model = PipeMLP()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    calls = _CountCalls()
    model.net[0].register_forward_pre_hook(calls)
    strategy = LayerSplitStrategy(
        devices=devices, n_microbatches=n_microbatches, balance=balance, activation_checkpointing=checkpointing
    )
    _trainer(strategy).fit(model, _loader())

    assert strategy.balance_used == expected_balance
    # Each step runs the first layer once per micro-batch, and again in the backward pass when it recomputes.
    per_step = len(chunk_rows) * (2 if checkpointing else 1)
    assert len(calls.rows) == 5 * per_step
    for step in range(5):
        rows = calls.rows[step * per_step : (step + 1) * per_step]
        assert rows[: len(chunk_rows)] == chunk_rows
        assert sorted(rows[len(chunk_rows) :]) == (sorted(chunk_rows) if checkpointing else [])
    assert len(model.losses) == len(reference.losses) == 5
    assert_close(torch.stack(model.losses), torch.stack(reference.losses), **TOL)
    for name, value in model.state_dict().items():
        assert_close(value, reference.state_dict()[name], **TOL, msg=name)
        # Control: every tensor moved far beyond the 1e-5 of the comparison, so parity is not two idle runs agreeing.
        assert_far({name: value}, {name: initial[name]}, 1e-3, f"{name} before training")


def test_microbatches_run_in_gpipe_clock_order():
    model = PipeMLP()
    order: list[tuple[int, int]] = []
    for stage, first_layer in enumerate((0, 3)):  # balance [3, 3]: stages start at layers 0 and 3
        model.net[first_layer].register_forward_pre_hook(lambda m, args, s=stage: order.append((s, args[0].shape[0])))
    _trainer(LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=4), max_steps=1).fit(model, _loader())
    # Fill-drain: stage 1 takes micro-batch i while stage 0 already works on i + 1 (depth-first would alternate 0, 1).
    assert order == [(j, 4) for tick in clock_cycles(4, 2) for _, j in tick]
    assert [s for s, _ in order] == [0, 0, 1, 0, 1, 0, 1, 1]


def test_batch_smaller_than_n_microbatches_gets_one_microbatch_per_row():
    model = PipeMLP()
    calls = _CountCalls()
    model.net[0].register_forward_pre_hook(calls)
    loader = DataLoader(TensorDataset(*_data(3)), batch_size=3)
    _trainer(LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=8), max_steps=1).fit(model, loader)
    assert calls.rows == [1, 1, 1]


def test_validate_under_the_strategy_matches_plain_validate():
    model = PipeMLP()
    expected = _trainer().validate(model, _loader(), verbose=False)[0]["val_loss"]
    got = _trainer(LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=4)).validate(
        model, _loader(), verbose=False
    )[0]["val_loss"]
    assert_close(got, expected, **TOL)
    assert type(model.net) is nn.Sequential


# --- balance --------------------------------------------------------------------------------------------------------


class _Sleep(nn.Module):
    def forward(self, x):
        time.sleep(0.02)
        return x * 1.0


def test_auto_balance_puts_a_slow_layer_alone_on_its_stage():
    model = PipeMLP()
    slow = _Sleep()
    model.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), slow, nn.Linear(16, 16), nn.Tanh())
    seen: dict[str, object] = {}

    class Spy(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["stages"] = [list(stage) for stage in pl_module.net._stages]

    strategy = LayerSplitStrategy(devices=["cpu"] * 3, balance="auto", n_microbatches=2)
    _trainer(strategy, max_steps=1, callbacks=[Spy()]).fit(model, _loader())
    assert strategy.balance_used == [2, 1, 2]
    assert seen["stages"][1] == [slow]


def test_auto_balance_without_example_input_array_says_how_to_set_it():
    model = PipeMLP(example=False)
    original = model.net
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], balance="auto")
    with pytest.raises(ValueError, match=r"self\.example_input_array"):
        _trainer(strategy).fit(model, _loader())
    assert model.net is original


def test_balance_with_the_wrong_sum_fails_at_setup_naming_the_numbers():
    model = PipeMLP()
    original = model.net
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], balance=[2, 2])
    with pytest.raises(ValueError, match=r"balance=\[2, 2\] sums to 4 but .* has 6 layers"):
        _trainer(strategy).fit(model, _loader())
    assert model.net is original and strategy.balance_used is None


def test_more_stages_than_layers_fails_at_setup():
    model = PipeMLP()
    model.net = nn.Sequential(nn.Linear(8, 16))
    with pytest.raises(ValueError, match=r"2 pipeline stages but .* only 1 layers"):
        _trainer(LayerSplitStrategy(devices=["cpu", "cpu"])).fit(model, _loader())


# --- the module before, during and after; checkpoints ---------------------------------------------------------------


def test_checkpoint_written_while_split_loads_into_a_plain_module_and_trainer(tmp_path):
    model = PipeMLP()
    original, keys = model.net, list(model.state_dict())
    during: dict[str, object] = {}

    class Spy(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            during["type"] = type(pl_module.net)
            during["same_layers"] = all(a is b for a, b in zip(pl_module.net, original, strict=True))
            during["keys"] = list(pl_module.state_dict())
            during["slice"] = type(pl_module.net[1:3])

    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="mp", every_n_train_steps=5, save_top_k=-1)
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=4)
    _trainer(strategy, enable_checkpointing=True, callbacks=[Spy(), checkpoint]).fit(model, _loader())

    assert during == {"type": MicroBatchedSequential, "same_layers": True, "keys": keys, "slice": nn.Sequential}
    assert model.net is original and type(model.net) is nn.Sequential
    assert list(model.state_dict()) == keys

    path = tmp_path / "mp.ckpt"
    saved = torch.load(path, weights_only=True)
    assert list(saved["state_dict"]) == keys
    assert all(t.device.type == "cpu" for t in saved["state_dict"].values())
    fresh = PipeMLP(seed=1)
    fresh.load_state_dict(saved["state_dict"], strict=True)
    for name, value in model.state_dict().items():
        assert_close(fresh.state_dict()[name], value, rtol=0, atol=0, msg=name)

    x, y = _data()
    with torch.no_grad():
        expected = F.cross_entropy(model(x), y)
    metrics = _trainer().validate(PipeMLP(seed=2), _loader(), ckpt_path=path, verbose=False)
    assert_close(torch.tensor(metrics[0]["val_loss"]), expected, **TOL)


def test_resume_restores_the_optimizer_state_like_a_plain_trainer(tmp_path):
    # Compared with a plain Trainer resuming the same file: Lightning's own resume semantics (which batch comes next
    # after an end-of-epoch checkpoint) are not what this test is about; SGD momentum makes the optimizer state count.
    first = PipeMLP()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="epoch0")
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=2)
    _trainer(strategy, max_steps=3, enable_checkpointing=True, callbacks=[checkpoint]).fit(first, _loader())
    path = tmp_path / "epoch0.ckpt"
    momentum = torch.load(path, weights_only=True)["optimizer_states"][0]["state"]
    assert momentum and all(s["momentum_buffer"].abs().sum() > 0 for s in momentum.values())

    plain = PipeMLP(seed=3)
    _trainer(max_steps=6).fit(plain, _loader(), ckpt_path=path)
    resumed = PipeMLP(seed=4)
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=2)
    _trainer(strategy, max_steps=6).fit(resumed, _loader(), ckpt_path=path)
    assert len(resumed.losses) == len(plain.losses) == 3
    assert_close(torch.stack(resumed.losses), torch.stack(plain.losses), **TOL)
    for name, value in plain.state_dict().items():
        assert_close(resumed.state_dict()[name], value, **TOL, msg=name)
    # Control: the same file without the momentum buffers resumes elsewhere, far beyond the comparison's 1e-5.
    dropped = PipeMLP(seed=5)
    _trainer(max_steps=6).fit(dropped, _loader(), ckpt_path=without_optimizer_state(path, tmp_path / "dropped.ckpt"))
    assert_far(resumed.state_dict(), dropped.state_dict(), 1e-3, "the resume without momentum")  # measured: 0.03


def test_an_exception_in_training_still_puts_the_original_sequential_back():
    class Failing(PipeMLP):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    model = Failing()
    original = model.net
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=2)).fit(model, _loader())
    assert model.net is original


# --- the module contract --------------------------------------------------------------------------------------------


def test_missing_attribute_names_it_and_the_option():
    model = PipeMLP()
    with pytest.raises(AttributeError, match=r"PipeMLP\.body.*pipe_module"):
        _trainer(LayerSplitStrategy(devices=["cpu", "cpu"], pipe_module="body")).fit(model, _loader())


def test_pipe_module_option_picks_another_attribute():
    model = PipeMLP()
    model.trunk = model.net  # the same nn.Sequential under a second name; `net` is left unsplit
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], pipe_module="trunk")
    seen = {}

    class Spy(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["trunk"], seen["net"] = type(pl_module.trunk), type(pl_module.net)

    _trainer(strategy, max_steps=1, callbacks=[Spy()]).fit(model, _loader())
    assert seen == {"trunk": MicroBatchedSequential, "net": nn.Sequential}
    assert model.trunk is model.net


def test_attribute_that_is_not_a_sequential_is_a_type_error():
    model = PipeMLP()
    model.net = nn.Linear(8, 16)
    with pytest.raises(TypeError, match=r"PipeMLP\.net`, which is a Linear, not an nn.Sequential"):
        _trainer(LayerSplitStrategy(devices=["cpu", "cpu"])).fit(model, _loader())


def test_sequential_subclass_with_its_own_forward_is_refused():
    class Residual(nn.Sequential):
        def forward(self, x):
            return x + super().forward(x)

    model = PipeMLP()
    model.net = Residual(nn.Linear(8, 8), nn.Tanh())
    with pytest.raises(TypeError, match="its own forward"):
        _trainer(LayerSplitStrategy(devices=["cpu", "cpu"])).fit(model, _loader())


# --- construction ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_microbatches": 0}, "n_microbatches=0 must be an integer >= 1"),
        ({"n_microbatches": 2.5}, "n_microbatches=2.5"),
        ({"n_microbatches": True}, "n_microbatches=True"),
        ({"devices": []}, r"devices=\[\] must be a non-empty list"),
        ({"devices": "cpu"}, "devices='cpu' must be a non-empty list"),
        ({"devices": ["cpu", "gpu:1"]}, "'gpu:1' is not a torch device"),
        ({"devices": ["cpu", "cuda:0"]}, r"mixes device types \['cpu', 'cuda'\].*devices=\['cpu', 'cpu'\]"),
        ({"devices": ["cuda:0", "cpu"]}, r"devices=\['cuda:0', 'cuda:1'\]"),
        ({"devices": ["cuda", "cuda"]}, "'cuda' has no index"),
        ({"devices": ["cpu", "cpu"], "balance": [1, 2, 3]}, r"balance=\[1, 2, 3\] has 3 entries .* 2 stages"),
        ({"devices": ["cpu", "cpu"], "balance": [0, 6]}, r"balance=\[0, 6\] must hold positive integers"),
        ({"devices": ["cpu", "cpu"], "balance": "fast"}, "balance='fast'"),
        ({"pipe_module": "model.net"}, "pipe_module='model.net'"),
        ({"activation_checkpointing": "yes"}, "activation_checkpointing='yes'"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerSplitStrategy(**kwargs)


def test_defaults_and_root_device():
    strategy = LayerSplitStrategy()
    if torch.cuda.is_available():
        expected = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        expected = [torch.device("cpu")] * 2
    assert strategy.stage_devices == expected
    assert strategy.root_device == expected[0]
    assert (strategy.n_microbatches, strategy.balance, strategy.pipe_module) == (1, None, "net")
    assert strategy.activation_checkpointing is False and strategy.balance_used is None


def test_the_devices_type_decides_the_accelerator():
    with pytest.raises(MisconfigurationException, match="CPU parallel_devices set through LayerSplitStrategy"):
        pl.Trainer(accelerator="cuda", strategy=LayerSplitStrategy(devices=["cpu", "cpu"]), logger=False)


def test_cuda_index_beyond_the_visible_devices_fails_before_setup(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    strategy = LayerSplitStrategy(devices=["cuda:0", "cuda:3"])
    with pytest.raises(ValueError, match=r"names \['cuda:3'\], but this machine shows 1 CUDA device"):
        strategy.setup_environment()


def test_register_strategies_adds_the_name():
    registry = _StrategyRegistry()
    LayerSplitStrategy.register_strategies(registry)
    LayerSplitStrategy.register_strategies(registry)  # a second import must not fail
    assert "ds_model_parallel" in registry
    assert isinstance(registry.get("ds_model_parallel"), LayerSplitStrategy)


@pytest.mark.parametrize(("balance_yaml", "balance"), [("auto", "auto"), ("[4, 2]", [4, 2]), ("null", None)])
def test_jsonargparse_builds_it_from_yaml(balance_yaml, balance):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=LayerSplitStrategy)
    cfg = parser.parse_string(
        "strategy:\n"
        "  class_path: ds_lightning.strategies.layer_split.LayerSplitStrategy\n"
        "  init_args:\n"
        "    devices: [cpu, cpu]\n"
        "    n_microbatches: 4\n"
        f"    balance: {balance_yaml}\n"
        "    activation_checkpointing: true\n"
    )
    strategy = parser.instantiate_classes(cfg).strategy
    assert isinstance(strategy, LayerSplitStrategy)
    assert strategy.stage_devices == [torch.device("cpu")] * 2
    assert (strategy.n_microbatches, strategy.balance, strategy.activation_checkpointing) == (4, balance, True)


# --- placement, with the meta device standing in for a second accelerator --------------------------------------------


def test_model_to_device_puts_each_stage_on_its_device_and_the_rest_on_the_root():
    model = PipeMLP()
    original = model.net
    strategy = LayerSplitStrategy(devices=["cpu", "cpu"], n_microbatches=2)
    strategy._stage_devices = [torch.device("cpu"), torch.device("meta")]  # no second GPU here: meta stands in
    strategy.connect(model)
    strategy.model_to_device()
    devices = {name: p.device.type for name, p in model.named_parameters()}
    assert devices == {
        "net.0.weight": "cpu", "net.0.bias": "cpu", "net.2.weight": "cpu", "net.2.bias": "cpu",
        "net.4.weight": "meta", "net.4.bias": "meta", "head.weight": "cpu", "head.bias": "cpu",
    }  # fmt: skip
    # Again (as a second setup would): moving the rest to the root must not touch stage 1, or meta -> cpu would fail.
    strategy.model_to_device()
    assert model.net[4].weight.device.type == "meta" and model.head.weight.device.type == "cpu"
    strategy._restore()
    assert model.net is original


def test_optimizer_states_follow_their_parameters():
    from ds_lightning.strategies.layer_split import _optimizer_states_to_param_devices

    on_cpu, on_meta = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))
    optimizer = torch.optim.Adam([on_cpu, on_meta])
    for p in (on_cpu, on_meta):
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
    _optimizer_states_to_param_devices([optimizer])
    assert {k: v.device.type for k, v in optimizer.state[on_meta].items()} == {
        "step": "cpu",
        "exp_avg": "meta",
        "exp_avg_sq": "meta",
    }
    assert all(v.device.type == "cpu" for v in optimizer.state[on_cpu].values())


# --- real devices ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_hold_one_stage_each():
    model = PipeMLP()
    seen: dict[str, object] = {}

    class Spy(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["params"] = {n: p.device for n, p in pl_module.named_parameters()}
            seen["states"] = {
                p.device: {t.device for t in s.values() if torch.is_tensor(t) and t.dim() > 0}
                for p, s in trainer.optimizers[0].state.items()
            }

    strategy = LayerSplitStrategy(devices=["cuda:0", "cuda:1"], n_microbatches=4)
    pl.Trainer(
        accelerator="cuda",
        strategy=strategy,
        max_steps=2,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[Spy()],
    ).fit(model, _loader())
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert seen["params"]["net.0.weight"] == cuda0 and seen["params"]["head.weight"] == cuda0
    assert seen["params"]["net.4.weight"] == cuda1
    assert all(devices == {device} for device, devices in seen["states"].items())
    assert all(p.device.type == "cpu" for p in model.parameters())
