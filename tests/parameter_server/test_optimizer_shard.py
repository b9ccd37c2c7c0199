"""Server-side optimizers over shards: what is refused, parity with one optimizer, LR handling, state round trips."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn

from ds_lightning.parameter_server.checkpoint import consolidate_state, split_full_state
from ds_lightning.parameter_server.optimizer_shard import ELEMENTWISE_OPTIMIZERS, ShardOptimizer, check_server_optimizer
from ds_lightning.parameter_server.sharding import ParameterShardPlan, plan_shards
from ds_lightning.sharding.optimizer_layout import index_by_name

MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _plan(model: nn.Module, num_servers: int) -> ParameterShardPlan:
    plan = plan_shards(_params(model), num_servers=num_servers, min_shard_bytes=64)
    servers_of: dict[str, set[int]] = {}
    for piece in plan.slices:
        servers_of.setdefault(piece.name, set()).add(piece.server)
    assert any(len(servers) > 1 for servers in servers_of.values()), "the plan must split some tensor across servers"
    return plan


def _sgd_momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _adam_two_groups(model: nn.Module) -> torch.optim.Optimizer:
    first, last = model[0], model[2]
    return torch.optim.Adam(
        [{"params": first.parameters(), "lr": 1e-2}, {"params": last.parameters(), "lr": 3e-2, "weight_decay": 0.1}],
        lr=1e-3,
        betas=(0.8, 0.95),
    )


class _Pair:
    """The reference (one optimizer on the full model) and the servers (one ShardOptimizer each, on a copy)."""

    def __init__(self, make: MakeOptimizer, num_servers: int) -> None:
        self.make = make
        self.model = _model()
        self.reference = make(self.model)
        self.plan = _plan(self.model, num_servers)
        self.shards = self.build_shards(_params(self.model))
        self.index_of = index_by_name(self.model, self.reference)
        self.shapes = {name: p.shape for name, p in _params(self.model).items()}
        self.generator = torch.Generator().manual_seed(1234)

    def build_shards(self, values: dict[str, torch.Tensor]) -> list[ShardOptimizer]:
        """Fresh ShardOptimizers over a copy of the model, their flat buffers holding ``values``."""
        copy_of_model = copy.deepcopy(self.model)
        template = self.make(copy_of_model)
        shards = []
        for server in range(self.plan.num_servers):
            shard = ShardOptimizer(template, _params(copy_of_model), self.plan, server)
            shard.flat.copy_(self.plan.flatten(values, server))
            shards.append(shard)
        return shards

    def step(self, steps: int) -> None:
        """Feed the same random full gradients to the reference and, sliced, to every server."""
        for _ in range(steps):
            grads = {n: torch.randn(p.shape, generator=self.generator) for n, p in _params(self.model).items()}
            for name, p in _params(self.model).items():
                p.grad = grads[name].clone()
            self.reference.step()
            for server, shard in enumerate(self.shards):
                shard.apply(self.plan.flatten(grads, server))

    def shard_values(self) -> dict[str, torch.Tensor]:
        tensors = {name: torch.full_like(p, float("nan")) for name, p in _params(self.model).items()}
        for server, shard in enumerate(self.shards):
            self.plan.unflatten_into(shard.flat, server, tensors)
        return tensors

    def assert_parameters_match(self) -> None:
        values = self.shard_values()
        for name, p in _params(self.model).items():
            torch.testing.assert_close(values[name], p.detach(), msg=lambda m, name=name: f"{name}: {m}")

    def export(self) -> dict:
        shards = [shard.export_state() for shard in self.shards]
        return consolidate_state(
            self.plan, shards, self.shapes, self.index_of, self.reference.state_dict()["param_groups"]
        )


def _assert_states_equal(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for index, state in expected.items():
        assert sorted(actual[index]) == sorted(state), index
        for key, value in state.items():
            torch.testing.assert_close(actual[index][key], value, msg=lambda m, i=index, k=key: f"{i}/{k}: {m}")


# check_server_optimizer ---------------------------------------------------------------------------------------------


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(_model().parameters(), lr=0.1)


def test_check_refuses_manual_optimization():
    with pytest.raises(ValueError, match="manual optimization"):
        check_server_optimizer([_sgd()], [], automatic_optimization=False)


def test_check_refuses_zero_optimizers():
    with pytest.raises(ValueError, match=r"exactly one optimizer.*returned 0"):
        check_server_optimizer([], [], automatic_optimization=True)


def test_check_refuses_two_optimizers_and_names_both_classes():
    params = list(_model().parameters())
    optimizers = [torch.optim.SGD(params[:2], lr=0.1), torch.optim.Adam(params[2:], lr=0.1)]
    with pytest.raises(ValueError, match="returned 2") as error:
        check_server_optimizer(optimizers, [], automatic_optimization=True)
    assert "SGD" in str(error.value)
    assert "Adam" in str(error.value)


def test_check_refuses_lbfgs_because_of_its_closure():
    optimizer = torch.optim.LBFGS(_model().parameters())
    with pytest.raises(ValueError, match="LBFGS") as error:
        check_server_optimizer([optimizer], [], automatic_optimization=True)
    assert "closure" in str(error.value)


class _CustomOptimizer(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):  # pragma: no cover - never stepped
        return None


class _PatchedSGD(torch.optim.SGD):
    """A subclass may override ``step``, so inheriting from a listed class is not enough."""


@pytest.mark.parametrize("cls", [_CustomOptimizer, _PatchedSGD])
def test_check_refuses_an_optimizer_class_outside_the_elementwise_list_and_names_it(cls):
    assert cls not in ELEMENTWISE_OPTIMIZERS
    optimizer = cls(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=cls.__name__) as error:
        check_server_optimizer([optimizer], [], automatic_optimization=True)
    assert "elementwise" in str(error.value)


def test_check_refuses_reduce_lr_on_plateau():
    optimizer = _sgd()
    config = LRSchedulerConfig(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), monitor="val_loss")
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        check_server_optimizer([optimizer], [config], automatic_optimization=True)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_check_accepts_sgd_and_adam_with_a_step_lr_scheduler(cls):
    optimizer = cls(_model().parameters(), lr=0.1)
    config = LRSchedulerConfig(torch.optim.lr_scheduler.StepLR(optimizer, step_size=2))
    check_server_optimizer([optimizer], [config], automatic_optimization=True)


# parity -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_servers", [2, 3])
@pytest.mark.parametrize("make", [_sgd_momentum, _adam_two_groups], ids=["sgd_momentum", "adam_two_groups"])
def test_shard_optimizers_match_one_optimizer_on_the_full_model(make, num_servers):
    pair = _Pair(make, num_servers)
    pair.assert_parameters_match()  # same start
    pair.step(5)
    pair.assert_parameters_match()


@pytest.mark.parametrize(
    "cls",
    ELEMENTWISE_OPTIMIZERS,
    ids=[cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS],
)
def test_every_elementwise_optimizer_is_rebuilt_exactly_on_the_shards(cls):
    pair = _Pair(lambda model: cls(model.parameters(), lr=0.01), 3)
    pair.step(3)
    pair.assert_parameters_match()
    _assert_states_equal(pair.export()["state"], pair.reference.state_dict()["state"])


# learning rate ------------------------------------------------------------------------------------------------------


def _plain_sgd_shards(lr: float = 0.1) -> tuple[ParameterShardPlan, torch.optim.Optimizer, list[ShardOptimizer]]:
    model = _model()
    plan = _plan(model, 2)
    template = torch.optim.SGD(model.parameters(), lr=lr)
    shards = []
    for server in range(plan.num_servers):
        shard = ShardOptimizer(template, _params(model), plan, server)
        shard.flat.copy_(plan.flatten(_params(model), server))
        shards.append(shard)
    return plan, template, shards


def test_lr_factor_half_moves_parameters_half_as_far_and_does_not_stick():
    _, template, halved = _plain_sgd_shards()
    _, _, full = _plain_sgd_shards()
    grad = torch.randn(halved[0].flat.numel(), generator=torch.Generator().manual_seed(7))
    start = halved[0].flat.clone()
    torch.testing.assert_close(full[0].flat, start)

    halved[0].apply(grad, lr_factor=0.5)
    full[0].apply(grad, lr_factor=1.0)
    half_step = halved[0].flat - start
    full_step = full[0].flat - start
    torch.testing.assert_close(full_step, -0.1 * grad)
    torch.testing.assert_close(half_step, 0.5 * full_step)
    assert template.param_groups[0]["lr"] == 0.1  # the template (the schedulers' view) is untouched

    # The next step with factor 1 is a full step again: the halved lr did not stay in the shard optimizer.
    before = halved[0].flat.clone()
    halved[0].apply(grad)
    torch.testing.assert_close(halved[0].flat - before, -0.1 * grad)
    assert halved[0].optimizer.param_groups[0]["lr"] == 0.1


def test_template_lr_changes_reach_the_shard_optimizer_at_the_next_apply():
    _, template, shards = _plain_sgd_shards(lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(template, step_size=1, gamma=0.5)
    scheduler.step()  # as Lightning would after a server step; the template itself never steps
    assert template.param_groups[0]["lr"] == pytest.approx(0.05)
    assert shards[1].learning_rates() == [pytest.approx(0.05)]

    grad = torch.randn(shards[1].flat.numel(), generator=torch.Generator().manual_seed(3))
    before = shards[1].flat.clone()
    shards[1].apply(grad)
    assert shards[1].optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    torch.testing.assert_close(shards[1].flat - before, -0.05 * grad)

    template.param_groups[0]["lr"] = 0.2  # set by hand, as any scheduler does
    shards[1].apply(grad)
    assert shards[1].optimizer.param_groups[0]["lr"] == 0.2
    assert shards[1].learning_rates() == [0.2]


def test_learning_rates_reports_each_template_group():
    pair = _Pair(_adam_two_groups, 2)
    template = pair.shards[0].template
    assert pair.shards[0].learning_rates() == [1e-2, 3e-2]
    template.param_groups[1]["lr"] = 7e-3
    template.param_groups[1]["betas"] = (0.5, 0.9)
    assert pair.shards[0].learning_rates() == [1e-2, 7e-3]
    pair.shards[0].sync_hyperparameters()
    assert [g["lr"] for g in pair.shards[0].optimizer.param_groups] == [1e-2, 7e-3]
    assert pair.shards[0].optimizer.param_groups[1]["betas"] == (0.5, 0.9)
    assert pair.shards[0].optimizer.param_groups[1]["weight_decay"] == 0.1


# optimizer state ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_servers", [2, 3])
def test_consolidated_state_equals_the_full_optimizer_state(num_servers):
    pair = _Pair(_adam_two_groups, num_servers)
    pair.step(3)
    consolidated = pair.export()
    expected = pair.reference.state_dict()
    _assert_states_equal(consolidated["state"], expected["state"])
    assert all("step" in state for state in consolidated["state"].values())
    assert consolidated["param_groups"] == expected["param_groups"]


@pytest.mark.parametrize("num_servers", [2, 3])
def test_split_full_state_then_import_resumes_exactly(num_servers):
    pair = _Pair(_adam_two_groups, num_servers)
    pair.step(3)
    consolidated = pair.export()

    # Restart the servers from the consolidated state, as a resume from a checkpoint would.
    current = {name: p.detach().clone() for name, p in _params(pair.model).items()}
    pair.shards = pair.build_shards(current)
    for server, shard in enumerate(pair.shards):
        entries, tensors = split_full_state(pair.plan, server, consolidated, pair.index_of)
        assert len(entries) == len(tensors) > 0
        shard.import_state(entries, tensors)
    _assert_states_equal(pair.export()["state"], pair.reference.state_dict()["state"])

    pair.step(3)
    pair.assert_parameters_match()
    _assert_states_equal(pair.export()["state"], pair.reference.state_dict()["state"])


def test_consolidated_state_loads_into_a_plain_adam_on_the_full_model():
    pair = _Pair(_adam_two_groups, 3)
    pair.step(3)
    consolidated = pair.export()

    model = copy.deepcopy(pair.model)
    fresh = _adam_two_groups(model)
    fresh.load_state_dict(consolidated)
    _assert_states_equal(fresh.state_dict()["state"], pair.reference.state_dict()["state"])
    assert [g["lr"] for g in fresh.param_groups] == [1e-2, 3e-2]

    # Both take the same next step.
    for p, q in zip(pair.model.parameters(), model.parameters(), strict=True):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(11))
        q.grad = p.grad.clone()
    pair.reference.step()
    fresh.step()
    for p, q in zip(pair.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p)
