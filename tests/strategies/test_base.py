"""ClusterStrategy and MirroredStrategy as drop-ins for Lightning's DDPStrategy, and the TF_CONFIG adoption hook."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import typing
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.constants import default_pg_timeout

from ds_lightning import (
    ClusterStrategy,
    LayerSplitStrategy,
    MirroredStrategy,
    ParameterServerStrategy,
    PipelineStrategy,
    TFConfigEnvironment,
    TFConfigError,
)
from ds_lightning.environments import TFConfig
from ds_lightning.environments.tf_config_adoption import check_tf_config
from tests.helpers.runner import REPO, worker_env

DROP_INS = [ClusterStrategy, MirroredStrategy, ParameterServerStrategy, PipelineStrategy]
WITHOUT_DDP_WRAPPER = (ParameterServerStrategy, PipelineStrategy)


def _params(cls: type) -> list[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self


def _members(hint: object) -> set[object]:
    """A type hint as the set of types it admits, with typing.List/Callable and list/abc.Callable made equal."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, type(int | None)) else (hint,)
    return {_normal(a) for a in args}


def _normal(hint: object) -> object:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None or origin is typing.Literal:
        return hint
    return (origin, tuple(_normal(a) for a in args)) if args else origin


@pytest.mark.parametrize("cls", DROP_INS)
def test_every_ddpstrategy_parameter_keeps_its_position_kind_and_default(cls):
    theirs, ours = _params(DDPStrategy), _params(cls)
    positional = theirs[:-1]  # all but **kwargs
    assert [(p.name, p.kind) for p in ours[: len(positional)]] == [(p.name, p.kind) for p in positional]
    for mine, base in zip(ours, positional, strict=False):
        assert mine.default == base.default, mine.name
    # ds options only keyword-only after them, and **kwargs last (for torch's DDP) where the model goes into DDP.
    wraps_ddp = cls not in WITHOUT_DDP_WRAPPER
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(positional) : len(ours) - wraps_ddp])
    assert (ours[-1].kind is inspect.Parameter.VAR_KEYWORD) is wraps_ddp


@pytest.mark.parametrize("cls", DROP_INS)
def test_every_type_ddpstrategy_accepts_is_accepted(cls):
    theirs = typing.get_type_hints(DDPStrategy.__init__)
    ours = typing.get_type_hints(cls.__init__)
    for name in [p.name for p in _params(DDPStrategy) if p.kind is not inspect.Parameter.VAR_KEYWORD]:
        assert _members(theirs[name]) <= _members(ours[name]), name
    assert timedelta in _members(ours["timeout"]) and float in _members(ours["timeout"])


def test_mirrored_options_are_keyword_only():
    options = [p.name for p in _params(MirroredStrategy) if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert options[:2] == ["gradient_compression", "powersgd_rank"]
    assert "gradient_as_bucket_view" in options and "even_batches" in options


def test_parameter_server_options_are_keyword_only():
    options = [p.name for p in _params(ParameterServerStrategy) if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert options[:3] == ["num_servers", "max_staleness", "staleness_lr"]


def test_parameter_server_takes_the_ddp_positions_and_a_timedelta():
    accelerator = CPUAccelerator()
    strategy = ParameterServerStrategy(accelerator, None, None, None, None, None, None, None, None, "gloo", 30)
    assert strategy.accelerator is accelerator and strategy.num_servers == 1
    assert strategy.process_group_backend == "gloo"
    assert strategy._timeout == timedelta(seconds=30) and strategy.timeout_seconds == 30.0
    assert ParameterServerStrategy(timeout=timedelta(minutes=2)).timeout_seconds == 120.0
    assert ParameterServerStrategy().timeout_seconds == default_pg_timeout.total_seconds()


@pytest.mark.parametrize("cls", WITHOUT_DDP_WRAPPER)
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("ddp_comm_hook", default_hooks.allreduce_hook),
        ("ddp_comm_state", object()),
        ("model_averaging_period", 4),
    ],
)
def test_strategies_without_a_ddp_wrapper_refuse_what_only_torch_ddp_would_use(cls, option, value):
    with pytest.raises(ValueError, match=rf"got {option}=.*(torch's DDP|not in DDP).*remove {option}"):
        cls(**{option: value})


def test_pipeline_takes_the_ddp_positions_and_a_timedelta():
    accelerator = CPUAccelerator()
    strategy = PipelineStrategy(accelerator, None, None, None, None, None, None, None, None, "gloo", 30, "spawn")
    assert strategy.accelerator is accelerator and strategy.schedule == "1F1B"
    assert strategy.process_group_backend == "gloo" and strategy._start_method == "spawn"
    assert strategy._timeout == timedelta(seconds=30)
    assert PipelineStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)
    options = [p.name for p in _params(PipelineStrategy) if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert options[:2] == ["schedule", "n_microbatches"]


def test_layer_split_keeps_single_device_strategys_positions():
    theirs, ours = _params(SingleDeviceStrategy), _params(LayerSplitStrategy)
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ours[: len(theirs)])
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs) :])
    accelerator = CPUAccelerator()
    strategy = LayerSplitStrategy("cpu", accelerator, devices=["cpu", "cpu"])
    assert strategy.accelerator is accelerator and strategy.root_device == torch.device("cpu")


def test_layer_split_refuses_a_device_that_is_not_the_first_stage():
    with pytest.raises(ValueError, match=r"device='meta' must be the first stage's device, 'cpu'.*leave device unset"):
        LayerSplitStrategy("meta", devices=["cpu", "cpu"])


def test_parameter_server_takes_no_keyword_arguments_for_torch_ddp():
    with pytest.raises(TypeError, match="broadcast_buffers"):
        ParameterServerStrategy(broadcast_buffers=False)  # type: ignore[call-arg]


def test_parameter_server_refuses_a_start_method_other_than_popen():
    with pytest.raises(ValueError, match=r"start_method='spawn'.*must be 'popen'"):
        ParameterServerStrategy(start_method="spawn")


def test_accelerator_given_positionally_is_the_accelerator():
    accelerator = CPUAccelerator()
    strategy = MirroredStrategy(accelerator)
    assert strategy.accelerator is accelerator
    assert strategy.gradient_compression == "none"


def test_every_ddp_argument_given_positionally_lands_where_ddpstrategy_puts_it():
    args = (None, None, None, None, None, None, None, None, 3, "gloo", timedelta(seconds=30), "spawn")
    for cls in (DDPStrategy, MirroredStrategy):
        strategy = cls(*args)
        assert strategy._model_averaging_period == 3
        assert strategy.process_group_backend == "gloo"
        assert strategy._timeout == timedelta(seconds=30)
        assert strategy._start_method == "spawn"


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [(timedelta(seconds=30), timedelta(seconds=30)), (30, timedelta(seconds=30)), (2.5, timedelta(seconds=2.5))],
)
def test_timeout_takes_seconds_or_a_timedelta(timeout, expected):
    assert MirroredStrategy(timeout=timeout)._timeout == expected


def test_timeout_none_means_torchs_default_as_in_ddpstrategy():
    assert MirroredStrategy(timeout=None)._timeout == default_pg_timeout
    assert MirroredStrategy()._timeout == DDPStrategy()._timeout == default_pg_timeout


@pytest.mark.parametrize(
    ("timeout", "message"),
    [(timedelta(0), r"timeout=datetime\.timedelta\(0\)"), (-1, "timeout=-1"), ("30", "timeout='30'"), (True, "True")],
)
def test_a_bad_timeout_is_refused_naming_the_value(timeout, message):
    with pytest.raises(ValueError, match=message):
        MirroredStrategy(timeout=timeout)


def test_extra_keyword_arguments_go_to_torch_ddp_with_the_mirrored_options():
    strategy = MirroredStrategy(broadcast_buffers=False, bucket_cap_mb=4)
    assert strategy._ddp_kwargs == {
        "bucket_cap_mb": 4,
        "static_graph": False,
        "find_unused_parameters": False,
        "gradient_as_bucket_view": True,
        "broadcast_buffers": False,
    }


def test_own_comm_hook_with_a_compression_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"ddp_comm_hook=.*gradient_compression='fp16'.*leave gradient_compression"):
        MirroredStrategy(ddp_comm_hook=default_hooks.allreduce_hook, gradient_compression="fp16")


def test_a_comm_wrapper_without_a_hook_is_refused():
    with pytest.raises(ValueError, match=r"ddp_comm_wrapper=.*pass ddp_comm_hook too"):
        MirroredStrategy(ddp_comm_wrapper=default_hooks.fp16_compress_wrapper)


def test_model_averaging_period_is_checked():
    with pytest.raises(ValueError, match="model_averaging_period=0"):
        MirroredStrategy(model_averaging_period=0)


def test_balancing_batches_refuses_an_own_comm_hook():
    strategy = MirroredStrategy(ddp_comm_hook=default_hooks.allreduce_hook)
    with pytest.raises(ValueError, match="remove ddp_comm_hook or the DynamicLoadBalancer"):
        strategy.balance_batches(lambda loader: loader)


@pytest.mark.multiprocess
def test_ddp_kwargs_and_an_own_comm_hook_reach_torch_ddp_in_a_two_process_run(tmp_path: Path):
    out = tmp_path / "dropin"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.dropin_run", str(out)],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in (0, 1):
        record = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert record["wrapped"] and record["broadcast_buffers"] is False
        assert record["global_step"] == 3
        assert record["hook_steps"] == 3 and record["hook_calls"] >= 3  # the user's hook ran every step
        assert record["timeout"] == 120
        assert record["replicas_equal"]


# --- TF_CONFIG adoption and its parameter-server hook --------------------------------------------------------------

TWO_HOSTS_WITH_PS = {
    "cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["10.0.0.3:2222"]},
    "task": {"type": "ps", "index": 0},
}


class _Serving(ClusterStrategy):
    strategy_name = "serving_test"
    serves_parameters = True


def test_a_ps_task_is_refused_unless_the_strategy_serves_parameters():
    config = TFConfig.from_dict(TWO_HOSTS_WITH_PS)
    with pytest.raises(TFConfigError, match=r"'ps' .*has no parameter servers"):
        check_tf_config("ds_mirrored", config, 1)
    check_tf_config("ds_parameter_server", config, 1, serves_parameters=True)


def test_a_serving_strategy_needs_a_ps_job():
    config = TFConfig.from_dict({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}})
    with pytest.raises(TFConfigError, match=r"no `cluster\.ps` job, so ds_parameter_server"):
        check_tf_config("ds_parameter_server", config, 1, serves_parameters=True)


def test_adoption_under_a_serving_strategy(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(TWO_HOSTS_WITH_PS))
    strategy = _Serving(cluster_environment=LightningEnvironment())
    config = strategy.adopt_cluster()
    assert config is strategy.tf_config and config.task_type == "ps"
    assert type(strategy.cluster_environment) is LightningEnvironment  # a server's environment is its own business
    assert strategy.num_nodes == 2 and strategy.spans_hosts and strategy.own_host == "10.0.0.3"


def test_a_worker_task_adopts_the_tf_config_environment(monkeypatch):
    worker = dict(TWO_HOSTS_WITH_PS, task={"type": "worker", "index": 1})
    monkeypatch.setenv("TF_CONFIG", json.dumps(worker))
    strategy = _Serving(parallel_devices=[torch.device("cpu")])
    strategy.set_world_ranks()
    assert isinstance(strategy.cluster_environment, TFConfigEnvironment)
    assert strategy.global_rank == 1 and strategy.world_size == 2 and strategy.own_host == "10.0.0.2"


def test_without_tf_config_nothing_is_adopted(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = MirroredStrategy(parallel_devices=[torch.device("cpu")] * 2)
    assert strategy.adopt_cluster() is None
    assert strategy.own_host is None and not strategy.spans_hosts
