"""ds_parameter_server: options, early errors, and real multi-process runs on gloo (workers + server processes)."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from jsonargparse import ArgumentParser
from torch import nn

import ds_lightning
from ds_lightning.environments import TFConfigError
from ds_lightning.parameter_server.launch import ServerLauncher, WorkerLauncher
from ds_lightning.parameter_server.push_compression import topk_count
from ds_lightning.parameter_server.tensor_messages import FRAME_BYTES
from tests.helpers import ps_runs
from tests.helpers.controls import assert_far, without_optimizer_state
from tests.helpers.ps_runs import Net, make_data
from tests.helpers.runner import REPO, ds_train, example_config, free_port, quiet_trainer_args, worker_env

PS = "ds_parameter_server"
# A run that must fail within its strategy's `timeout` may also take this long to start its processes and to stop.
START_AND_STOP_MARGIN_S = 60


# --- options and early errors (no processes) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_servers": 0}, "num_servers=0"),
        ({"max_staleness": -1}, "max_staleness=-1"),
        ({"staleness_lr": "sqrt"}, "staleness_lr='sqrt'"),
        ({"push_every": 0}, "push_every=0"),
        ({"gradient_compression": "zip"}, "gradient_compression='zip' is not supported; choose one of 'none'"),
        ({"compression": "zip"}, "gradient_compression='zip'"),  # the deprecated name, checked as the new one
        ({"gradient_compression": "powersgd"}, r"'powersgd' does not work with ds_parameter_server's gradient pushes"),
        ({"gradient_compression": "auto"}, "choose one of 'none', 'fp16', 'bf16', 'topk'"),
        ({"compression": "topk", "gradient_compression": "fp16"}, "keep only gradient_compression"),
        ({"topk_ratio": 0.0}, "topk_ratio=0.0"),
        ({"max_updates": 0}, "max_updates=0"),
        ({"timeout": 0}, "timeout=0"),
    ],
)
def test_bad_options_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ds_lightning.ParameterServerStrategy(**kwargs)


@pytest.mark.parametrize("option", ["gradient_compression", "compression"])
def test_yaml_takes_gradient_compression_and_its_deprecated_name(option: str) -> None:
    """jsonargparse (what LightningCLI and ds-train parse with) accepts both names; only the old one warns."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=ds_lightning.ParameterServerStrategy)
    path = "ds_lightning.strategies.ParameterServerStrategy"
    config = parser.parse_string(f"strategy:\n  class_path: {path}\n  init_args:\n    {option}: topk\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = parser.instantiate_classes(config).strategy
    assert strategy.gradient_compression == "topk"
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    named = [m for m in deprecations if "compression='topk' is deprecated: write gradient_compression='topk'" in m]
    assert len(named) == (option == "compression"), deprecations


def test_the_deprecated_name_warns_naming_the_new_option() -> None:
    with pytest.warns(DeprecationWarning, match="write gradient_compression='fp16'"):
        strategy = ds_lightning.ParameterServerStrategy(compression="fp16")
    assert strategy.gradient_compression == "fp16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name alone warns about nothing
        assert ds_lightning.ParameterServerStrategy(gradient_compression="fp16").gradient_compression == "fp16"


def _tf_config(monkeypatch: pytest.MonkeyPatch, cluster: dict[str, Any], task: tuple[str, int]) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": task[0], "index": task[1]}}))


CLUSTER = {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001"], "ps": ["127.0.0.1:2002"]}


def test_tf_config_without_ps_tasks_is_refused_when_the_trainer_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    _tf_config(monkeypatch, {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001"]}, ("chief", 0))
    with pytest.raises(TFConfigError, match=r"no `cluster.ps`"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=PS)


def test_tf_config_and_num_servers_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    _tf_config(monkeypatch, CLUSTER, ("chief", 0))
    with pytest.raises(TFConfigError, match=r"num_servers=2 but TF_CONFIG lists 1 ps"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=ds_lightning.ParameterServerStrategy(num_servers=2))


def test_tf_config_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    _tf_config(monkeypatch, CLUSTER, ("ps", 0))
    server = pl.Trainer(accelerator="cpu", devices=1, strategy=PS, logger=False)
    assert server.strategy.is_server and isinstance(server.strategy.launcher, ServerLauncher)
    assert server.global_rank == 2 and server.world_size == 2  # ranks after the 2 workers; never rank zero
    _tf_config(monkeypatch, CLUSTER, ("worker", 0))
    worker = pl.Trainer(accelerator="cpu", devices=1, strategy=PS, logger=False)
    assert not worker.strategy.is_server and isinstance(worker.strategy.launcher, WorkerLauncher)
    assert worker.global_rank == 1 and worker.num_nodes == 2 and worker.strategy.num_servers == 1
    _tf_config(monkeypatch, {**CLUSTER, "evaluator": ["127.0.0.1:2003"]}, ("evaluator", 0))
    with pytest.raises(TFConfigError, match="evaluator"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=PS)


def test_several_nodes_need_tf_config() -> None:
    with pytest.raises(ValueError, match="needs TF_CONFIG"):
        pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=PS)


class _Tiny(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layer = nn.Linear(4, 2)
        if kind == "frozen":
            self.layer.requires_grad_(False)
        if kind == "manual":
            self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        sgd = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.kind == "two":
            return [sgd, torch.optim.Adam(self.parameters())]
        if self.kind == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        if self.kind == "plateau":
            return {
                "optimizer": sgd,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(sgd), "monitor": "loss"},
            }
        if self.kind == "custom":
            return _Custom(self.parameters())
        return sgd


class _Custom(torch.optim.SGD):
    pass


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("frozen", "no trainable parameters"),
        ("manual", "manual optimization"),
        ("two", r"returned 2 \(\['SGD', 'Adam'\]\)"),
        ("lbfgs", "LBFGS needs a closure"),
        ("plateau", "ReduceLROnPlateau"),
        ("custom", "cannot rebuild _Custom"),
    ],
)
def test_models_the_servers_cannot_train_fail_before_any_process_starts(kind: str, match: str) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=PS, logger=False, enable_progress_bar=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    with pytest.raises(ValueError, match=match):
        trainer.fit(_Tiny(kind), data)
    launcher = trainer.strategy.launcher
    assert isinstance(launcher, WorkerLauncher)
    assert launcher.procs == [] and launcher.servers == []  # refused before starting workers or servers


# --- real runs ----------------------------------------------------------------------------------------------------


def _run(tmp_path: Path, name: str, spec: dict[str, Any], timeout: float = 150, check: bool = True) -> dict[str, Any]:
    """Run tests/helpers/ps_runs.py with ``spec``; return rank 0's results (and the exit code and output)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / name
    spec = {"strategy": PS, "out": str(out), **spec}
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    start = time.monotonic()
    if spec["strategy"] == "single":  # the one-process reference launches nothing: it runs here, without the imports
        ps_runs.main(str(spec_path))
        return _results(spec, out, {"returncode": 0, "output": "", "seconds": time.monotonic() - start})
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.ps_runs", str(spec_path)],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    result: dict[str, Any] = {"returncode": proc.returncode, "output": proc.stdout, "seconds": time.monotonic() - start}
    if check:
        assert proc.returncode == 0, proc.stdout[-6000:]
    return _results(spec, out, result)


def _results(spec: dict[str, Any], out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with what each rank wrote under ``out``."""
    for rank in range(spec.get("devices", 2)):
        path = Path(f"{out}.rank{rank}.json")
        if path.exists():
            result[f"rank{rank}"] = json.loads(path.read_text())
    if Path(f"{out}.pt").exists():
        result["params"] = torch.load(f"{out}.pt")
    return result


def _plain_resume(tmp_path: Path, name: str, spec: dict[str, Any], checkpoint: Path) -> dict[str, torch.Tensor]:
    """A plain single-device Trainer resumes ``checkpoint`` in this process (no launch); its final state dict."""
    out = tmp_path / name
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(json.dumps({**spec, "strategy": "single", "out": str(out), "ckpt_path": str(checkpoint)}))
    ps_runs.main(str(spec_path))
    return torch.load(f"{out}.pt")


def _assert_resume_needs_the_momentum(
    tmp_path: Path, spec: dict[str, Any], checkpoint: Path, resumed: dict[str, torch.Tensor]
) -> None:
    """The control for a resume compared at 1e-6 to 1e-5: without the momentum buffers it ends more than 1e-3 away
    (measured: 0.04 and 0.28)."""
    dropped = without_optimizer_state(checkpoint, tmp_path / "no_momentum.ckpt")
    assert_far(resumed, _plain_resume(tmp_path, "no_momentum", spec, dropped), 1e-3, "the resume without momentum")


def _assert_no_process_left(tmp_path: Path) -> None:
    found = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert found == [], f"processes left behind: {found}"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("servers", "model"),
    [
        ({"num_servers": 1}, {"scheduler": "step"}),
        ({"num_servers": 2, "min_shard_bytes": 64}, {"scheduler": "epoch", "optimizer": "adam", "lr": 0.01}),
    ],
    ids=["1server-sgd-momentum-step-lr", "2servers-split-adam-epoch-lr"],
)
def test_bulk_synchronous_equals_one_process_on_the_global_batch(
    tmp_path: Path, servers: dict[str, Any], model: dict[str, Any]
) -> None:
    common = {"model": model, "max_epochs": 2, "n": 128, "batch_size": 8}
    ps = _run(tmp_path, "ps", {**common, "strategy_kwargs": {"max_staleness": 0, **servers}})
    single = _run(tmp_path, "single", {**common, "strategy": "single"})
    assert ps["rank0"]["global_step"] == ps["rank1"]["global_step"] == single["rank0"]["global_step"] == 16
    for name, value in single["params"].items():
        torch.testing.assert_close(ps["params"][name], value, rtol=0, atol=1e-5)
    # self.log(sync_dist=True) averaged over the two workers only, not over the server
    assert ps["rank0"]["metrics"]["rank_mean"] == pytest.approx(0.5)
    _assert_no_process_left(tmp_path)


@pytest.mark.multiprocess
def test_accumulation_and_fp16_callbacks_push_unscaled_windows_and_an_overflow_pushes_nothing(tmp_path: Path) -> None:
    # Bulk-synchronous, so the servers' result must equal one process running the same callbacks on the global batch.
    common = {"max_epochs": 3, "n": 64, "batch_size": 8, "accumulate": 2, "model": {"inf_at_step": 2}}
    common["amp"] = {"precision": "fp16", "init_scale": 1024.0}
    ps = _run(tmp_path, "ps", {**common, "strategy_kwargs": {"max_staleness": 0}})
    single = _run(tmp_path, "single", {**common, "strategy": "single"})
    # 4 batches per worker and epoch in windows of 2: 6 optimizer steps, the third overflows and is skipped.
    assert ps["rank0"]["global_step"] == ps["rank1"]["global_step"] == single["rank0"]["global_step"] == 6
    # Updates the servers had applied, seen after each micro-batch: one per window, none for the overflowing third
    # window, after which the worker computes its next window on the same parameters (nothing new to pull).
    assert [pull["updates"] for pull in ps["rank0"]["pulls"]] == [0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4]
    initial = dict(_net_parameters())
    for name, value in single["params"].items():
        assert torch.isfinite(ps["params"][name]).all()
        assert not torch.allclose(value, initial[name])
        # fp16 autocast rounds differently in the two runs; pushing scaled (x1024) gradients would be far off.
        torch.testing.assert_close(ps["params"][name], value, rtol=0, atol=2e-3)


@pytest.mark.multiprocess
def test_auto_mixed_precision_decides_on_each_worker_without_a_collective_the_server_never_joins(
    tmp_path: Path,
) -> None:
    # Workers step on their own under a parameter server, so auto's timing agreement must not be a collective over
    # the default group (which a server does not join): each worker decides, and the run ends on every process.
    spec = {"max_epochs": 1, "n": 32, "batch_size": 8, "amp": {"precision": "auto", "probe_passes": 3}}
    ps = _run(tmp_path, "ps", {**spec, "strategy_kwargs": {"max_staleness": 0}}, timeout=240)
    assert ps["rank0"]["global_step"] == ps["rank1"]["global_step"] == 2
    assert ps["output"].count("MixedPrecision('auto')") >= 1, ps["output"][-3000:]
    _assert_no_process_left(tmp_path)


# Two servers with split tensors train asynchronously in tests/cluster/test_multihost.py, each on its own host.
@pytest.mark.multiprocess
@pytest.mark.parametrize("servers", [1])
def test_asynchronous_training_reaches_90_percent_on_digits(tmp_path: Path, servers: int) -> None:
    report = tmp_path / "report.json"
    ds_train(
        [
            "fit",
            *example_config("parameter_server.yaml"),
            f"--trainer.strategy.init_args.num_servers={servers}",
            "--trainer.strategy.init_args.min_shard_bytes=4096",
            *quiet_trainer_args(tmp_path),
            "--trainer.callbacks=ds_lightning.demos.TrainingReport",
            f"--trainer.callbacks.output_json={report}",
            # 8 epochs, not the example's 5: asynchronous updates depend on how the workers interleave, and beside
            # the other pytest worker on 2 cores one run ended at 0.8997 after 5 (alone: 0.95 to 0.96).
            "--trainer.max_epochs=8",
        ],
        timeout=280,  # under pytest's own 300 s
    )
    assert json.loads(report.read_text())["val_acc"] >= 0.90


@pytest.mark.multiprocess
def test_stale_synchronous_bound_holds_under_a_slow_worker(tmp_path: Path) -> None:
    slow = {"slow": {"rank": 1, "delay": 0.05}, "max_epochs": 2, "limit_val_batches": 1}
    bounded = _run(tmp_path, "ssp", {**slow, "strategy_kwargs": {"max_staleness": 2}})
    gaps = [pull["clocks"][0] - min(pull["clocks"]) for pull in bounded["rank0"]["pulls"]]
    assert max(gaps) == 2, gaps  # the fast worker ran ahead up to the bound, never past it
    free = _run(tmp_path, "async", {**slow, "strategy_kwargs": {"max_staleness": None}})
    free_gaps = [pull["clocks"][0] - min(pull["clocks"]) for pull in free["rank0"]["pulls"]]
    assert max(free_gaps) > 2, free_gaps  # without the bound the same straggler falls further behind


def _metrics(root: Path) -> list[dict[str, str]]:
    files = sorted(root.rglob("metrics.csv"))
    assert files, f"no metrics.csv under {root}"
    return list(csv.DictReader(files[-1].open()))


@pytest.mark.multiprocess
def test_a_killed_worker_does_not_stop_the_others(tmp_path: Path) -> None:
    spec = {"kill_worker": {"rank": 1, "step": 5}, "max_epochs": 3, "csv": True, "strategy_kwargs": {"timeout": 60}}
    run = _run(tmp_path, "kill", spec)
    assert "rank1" not in run  # it was SIGKILLed at step 5
    assert run["rank0"]["global_step"] == 24  # the chief trained all 3 epochs of 8 steps
    assert "lost worker 1" in run["output"]
    rows = _metrics(tmp_path)
    assert max(int(r["step"]) for r in rows if r.get("train_loss")) >= 20  # the loss was still logged after the kill
    last_val = [r for r in rows if r.get("rank_mean")][-1]
    assert float(last_val["rank_mean"]) == 0.0  # sync_dist reduced over the surviving worker only
    _assert_no_process_left(tmp_path)


@pytest.mark.multiprocess
def test_a_killed_server_stops_every_worker_and_the_checkpoint_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    timeout = 60
    spec = {"max_epochs": 3, "ckpt_dir": str(ckpt), "strategy_kwargs": {"timeout": timeout, "max_staleness": 0}}
    run = _run(tmp_path, "killed", {**spec, "kill_server": {"epoch": 1, "step": 11}}, check=False)
    assert run["returncode"] != 0
    for rank in (0, 1):
        assert (
            f"Lost parameter server 0 (ps task 0 at 127.0.0.1, process-group rank 2) while worker {rank}"
            in (run["output"])
        )
    assert run["seconds"] < timeout + START_AND_STOP_MARGIN_S  # stopped by the timeout, not hung
    _assert_no_process_left(tmp_path)
    # The hang verdict: every worker names the server that stopped answering, and dumps its Flight Recorder.
    assert run["output"].count("Did not answer: parameter server 0 (rank 2)") == 2, run["output"][-6000:]
    for rank in (0, 1):
        verdict = json.loads((tmp_path / "flight_recorder" / f"verdict_rank{rank}.json").read_text())
        assert (verdict["kind"], verdict["silent"], verdict["arrived"]) == ("silent", [2], [rank])
        assert (tmp_path / "flight_recorder" / f"fr_rank_{rank}").exists()
    last = ckpt / "epoch=0-step=8.ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [last.name]
    resumed = _run(tmp_path, "resumed", {**spec, "ckpt_dir": None, "ckpt_path": str(last)})
    assert resumed["rank0"]["global_step"] == 24
    # Bulk-synchronous, so the resumed run is a plain Trainer resuming the same file on the global batch; the step
    # count alone would not tell a resume from 24 steps from scratch.
    expected = _plain_resume(tmp_path, "plain", {"max_epochs": 3}, last)
    for name, value in expected.items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-5)
    _assert_resume_needs_the_momentum(tmp_path, {"max_epochs": 3}, last, resumed["params"])


@pytest.mark.multiprocess
def test_a_server_that_fails_to_start_stops_the_run_at_once(tmp_path: Path) -> None:
    # timeout=600: without the chief watching its servers, the workers would wait that long for the rendezvous.
    run = _run(tmp_path, "crash", {"crash_server": True, "strategy_kwargs": {"timeout": 600}}, check=False)
    assert run["returncode"] != 0
    assert "parameter server 0 (pid" in run["output"] and "exited with code 1 before it connected" in run["output"]
    _assert_no_process_left(tmp_path)


@pytest.mark.multiprocess
def test_checkpoints_are_consolidated_resume_exactly_and_load_into_a_plain_trainer(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    common = {"model": {"scheduler": "step"}, "max_epochs": 3}
    full = _run(tmp_path, "full", {**common, "ckpt_dir": str(ckpt), "strategy_kwargs": {"max_staleness": 0}})
    first = ckpt / "epoch=0-step=8.ckpt"
    saved = torch.load(first, weights_only=True)
    names = [n for n, _ in _net_parameters()]
    assert set(saved["state_dict"]) == set(full["params"])
    state = saved["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(names)))
    for index, (_, param) in enumerate(_net_parameters()):
        assert state[index]["momentum_buffer"].shape == param.shape
        assert state[index]["momentum_buffer"].abs().sum() > 0
    assert saved["lr_schedulers"][0]["last_epoch"] == 8  # the servers stepped the StepLR once per update
    assert saved["ds_parameter_server"]["num_servers"] == 1 and saved["ds_parameter_server"]["updates"] == 8
    # Resuming with two servers gives the uninterrupted run's parameters: momentum and LR state came back.
    resumed = _run(
        tmp_path,
        "resumed",
        {
            **common,
            "ckpt_path": str(first),
            "strategy_kwargs": {"max_staleness": 0, "num_servers": 2, "min_shard_bytes": 64},
        },
    )
    for name, value in full["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-6)
    # A plain single-process Trainer resumes from the same file, and on the global batch it is the same training.
    plain = _run(tmp_path, "plain", {**common, "strategy": "single", "ckpt_path": str(first)})
    assert plain["rank0"]["global_step"] == 24
    for name, value in full["params"].items():
        torch.testing.assert_close(plain["params"][name], value, rtol=0, atol=1e-5)
    _assert_resume_needs_the_momentum(tmp_path, common, first, resumed["params"])


def _net_parameters() -> list[tuple[str, torch.Tensor]]:
    return list(Net().named_parameters())


@pytest.mark.multiprocess
def test_a_late_worker_and_an_early_finisher_do_not_deadlock_the_others(tmp_path: Path) -> None:
    spec = {
        "late_worker": {"rank": 1, "seconds": 3},
        "stop_worker": {"rank": 1, "step": 6},
        "max_epochs": 3,
        "strategy_kwargs": {"max_staleness": 1, "timeout": 60},
    }
    run = _run(tmp_path, "late", spec)
    assert run["rank0"]["global_step"] == 24
    assert run["rank1"]["global_step"] < 10  # it stopped early; the chief finished alone
    assert max(p["clocks"][0] - min(p["clocks"]) for p in run["rank0"]["pulls"][:3]) <= 1  # waited for the late one


@pytest.mark.multiprocess
def test_update_budget_compression_and_traffic_logging(tmp_path: Path) -> None:
    base = {"max_epochs": 50, "csv": True, "limit_val_batches": 0}
    # fp16/bf16 pushes run live in test_half_precision_pushes_halve_the_bytes_and_still_train.
    dense = _run(tmp_path / "dense", "run", {**base, "strategy_kwargs": {"max_updates": 20}})
    topk = _run(
        tmp_path / "topk",
        "run",
        {
            **base,
            "strategy_kwargs": {"max_updates": 20, "gradient_compression": "topk", "topk_ratio": 0.02, "push_every": 2},
        },
    )
    for run in (dense, topk):
        updates = max(run[f"rank{r}"]["pulls"][-1]["updates"] for r in (0, 1))
        assert 20 <= updates <= 21  # the budget stopped both workers (a push in flight may land after it)
        steps = run["rank0"]["global_step"] + run["rank1"]["global_step"]
        per_push = 2 if run is topk else 1
        assert steps <= per_push * updates + 2 * per_push  # each worker runs at most one window past the stop
    pushed = {}
    for name in ("dense", "topk"):
        rows = [r for r in _metrics(tmp_path / name) if r.get("ps/bytes_pushed")]
        pushed[name] = max(float(r["ps/bytes_pushed"]) for r in rows)
    params = sum(p.numel() for _, p in _net_parameters())
    # One push is the wire's header frame plus its payload: fp32, or top-k's int64 indices and fp32 values.
    assert pushed["dense"] == FRAME_BYTES + 4 * params
    assert pushed["topk"] == FRAME_BYTES + topk_count(params, 0.02) * (8 + 4)


@pytest.mark.multiprocess
def test_a_tf_config_cluster_of_three_hand_started_tasks(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"], "ps": [f"127.0.0.1:{ports[2]}"]}
    report = tmp_path / "report.json"
    args = [
        "fit",
        *example_config("parameter_server.yaml"),
        "--trainer.devices=1",
        "--trainer.max_epochs=3",
        *quiet_trainer_args(tmp_path),
        "--trainer.callbacks=ds_lightning.demos.TrainingReport",
        f"--trainer.callbacks.output_json={report}",
    ]
    procs = []
    for job in ("ps", "worker", "chief"):
        env = worker_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": job, "index": 0}}))
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            env.pop(var)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ds_lightning.cli", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            proc.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], "\n\n".join(o[-3000:] for o in outputs)
    assert json.loads(report.read_text())["val_acc"] >= 0.85
    assert re.search(r"parameter server 0 done: \d+ updates .* workers finished \[(0, 1|1, 0)\], lost \[\]", outputs[0])


def _own_sync(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    return [tensor]


def test_metric_syncs_are_routed_to_the_live_workers_stay_picklable_and_are_undone_at_teardown() -> None:
    import pickle

    from torchmetrics import Metric
    from torchmetrics.classification import MulticlassAccuracy

    from ds_lightning.demos import DigitsClassifier
    from ds_lightning.parameter_server.collectives import LiveWorkersGather as _LiveWorkersGather
    from ds_lightning.strategies import ParameterServerStrategy

    def syncs(module: nn.Module) -> list:
        return [m.dist_sync_fn for m in module.modules() if isinstance(m, Metric)]

    model = DigitsClassifier(hidden_sizes=[8])
    model.users_metric = MulticlassAccuracy(num_classes=10, dist_sync_fn=_own_sync)
    strategy = ParameterServerStrategy()
    strategy._lightning_module = model
    strategy._route_metric_syncs()
    routed = [fn for fn in syncs(model) if isinstance(fn, _LiveWorkersGather)]
    assert len(routed) == len(syncs(model)) - 1 >= 1
    assert model.users_metric.dist_sync_fn is _own_sync  # a user's own sync function is left alone
    # torch.save(model) and spawn launchers pickle the module; the copy gathers plainly.
    copied = [fn for fn in syncs(pickle.loads(pickle.dumps(model))) if isinstance(fn, _LiveWorkersGather)]
    assert len(copied) == len(routed) and all(fn._strategy() is None for fn in copied)
    strategy._unroute_metric_syncs()
    assert syncs(model).count(None) == len(routed)
    assert model.users_metric.dist_sync_fn is _own_sync


# --- after fit, and options run live ------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_validate_test_and_predict_after_fit_use_the_final_parameters(tmp_path: Path) -> None:
    run = _run(tmp_path, "eval", {"max_epochs": 2, "n": 128, "evaluate": True})
    final = Net()
    final.load_state_dict(run["params"])
    assert any(not torch.equal(run["params"][n], p) for n, p in _net_parameters())  # fit did train
    x, y = make_data(128).tensors
    with torch.no_grad():
        logits = final(x)
    # Each worker's loader holds 64 samples in 2 batches of 32; equal sizes, so the synced mean is the global one.
    loss = float(nn.functional.cross_entropy(logits, y))
    acc = float((logits.argmax(1) == y).float().mean())
    for rank in (0, 1):
        evaluated = json.loads((tmp_path / f"eval.evaluated.rank{rank}.json").read_text())
        assert evaluated["validate"]["val_loss"] == pytest.approx(loss, rel=1e-5)
        assert evaluated["validate"]["val_acc"] == pytest.approx(acc, rel=1e-6)
        assert evaluated["test"]["test_loss"] == pytest.approx(loss, rel=1e-5)
        assert evaluated["test"]["test_acc"] == pytest.approx(acc, rel=1e-6)
        predictions = torch.load(tmp_path / f"eval.predictions.rank{rank}.pt")
        assert predictions.shape == (64, 4)  # this worker's half of the samples (r, r + 2, ...), one row each
        torch.testing.assert_close(predictions, logits[rank::2], rtol=1e-5, atol=1e-6)


def _pushed_bytes(root: Path) -> float:
    return max(float(r["ps/bytes_pushed"]) for r in _metrics(root) if r.get("ps/bytes_pushed"))


@pytest.mark.multiprocess
@pytest.mark.parametrize(("option", "compression"), [("gradient_compression", "fp16"), ("compression", "bf16")])
def test_half_precision_pushes_halve_the_bytes_and_still_train(tmp_path: Path, option: str, compression: str) -> None:
    """bf16 goes through the deprecated option name ``compression``, which must still select the method."""
    spec = {"max_epochs": 2, "csv": True, "strategy_kwargs": {"max_staleness": 0, option: compression}}
    run = _run(tmp_path / compression, "run", spec)
    params = sum(p.numel() for _, p in _net_parameters())
    assert _pushed_bytes(tmp_path / compression) == FRAME_BYTES + 2 * params  # 2 bytes an entry, not fp32's 4
    losses = run["rank0"]["losses"]
    assert len(losses) == 16 and sum(losses[8:]) < sum(losses[:8])  # the servers decoded and applied the pushes
    for name, initial in _net_parameters():
        assert torch.isfinite(run["params"][name]).all() and not torch.equal(run["params"][name], initial)


def _server_lines(output: str, server: int) -> tuple[int, int]:
    """What server ``server`` printed: the parameters it held, and the updates it applied."""
    held = re.search(rf"parameter server {server} serving (\d+) parameters", output)
    done = re.search(rf"parameter server {server} done: (\d+) updates .* workers finished \[(0, 1|1, 0)\]", output)
    assert held and done, output[-4000:]
    return int(held.group(1)), int(done.group(1))


@pytest.mark.multiprocess
@pytest.mark.parametrize("staleness_lr", ["none", "inverse"])
def test_inverse_staleness_lr_scales_each_stale_update(tmp_path: Path, staleness_lr: str) -> None:
    # Every gradient entry is 1 and plain SGD has no state, so each update moves every parameter by lr * factor:
    # the total move is lr * (number of updates) without the rule, and less with it once some update was stale.
    lr = 0.01
    spec = {
        "max_epochs": 2,
        "n": 64,
        "limit_val_batches": 0,
        "slow_push": {"rank": 1, "delay": 0.2},  # between pull and push: several of the fast worker's updates land
        "model": {"linear_loss": True, "momentum": 0.0, "lr": lr},
        "strategy_kwargs": {"staleness_lr": staleness_lr},
    }
    run = _run(tmp_path, "run", spec)
    _, updates = _server_lines(run["output"], 0)
    assert updates == run["rank0"]["global_step"] + run["rank1"]["global_step"] == 16  # asynchronous: one a push
    staleness = [p["staleness_max"] for r in (0, 1) for p in run[f"rank{r}"]["pulls"]]
    assert max(staleness) >= 2, staleness  # some update was at least 2 behind: "inverse" must halve it at least
    # The fast worker waited for the slow one at the end: both hold the servers' final parameters, not their last pull.
    assert run["rank0"]["param_sum"] == run["rank1"]["param_sum"]
    moved = [float((initial - run["params"][n].detach()).mean()) for n, initial in _net_parameters()]
    if staleness_lr == "none":
        assert moved == pytest.approx([lr * updates] * len(moved), rel=1e-4)
    else:
        assert all(lr <= m <= lr * (updates - 0.5) + 1e-5 for m in moved), moved


@pytest.mark.multiprocess
def test_asynchronous_training_with_two_servers_updates_both_shards(tmp_path: Path) -> None:
    spec = {"max_epochs": 2, "strategy_kwargs": {"num_servers": 2, "min_shard_bytes": 64}}
    run = _run(tmp_path, "run", spec)
    held = [_server_lines(run["output"], s) for s in (0, 1)]
    assert all(numel > 0 for numel, _ in held)
    assert sum(numel for numel, _ in held) == sum(p.numel() for _, p in _net_parameters())  # each entry on one
    pushes = run["rank0"]["global_step"] + run["rank1"]["global_step"]
    assert [updates for _, updates in held] == [pushes, pushes]  # asynchronous: every push updated both shards
    for name, initial in _net_parameters():
        assert (run["params"][name] != initial).all(), name  # every entry moved, on whichever server holds it
