"""``torch.compile`` under every ds strategy: the compiled model's parameters after a few steps equal the eager run's
(within 1e-5), or the strategy refuses at set-up, naming why and the fix (docs/compile.md).

Each run compiles for real (``tests/helpers/compile_runs.py``); its record says how many graphs rank 0 compiled, so a
parity that held because nothing was compiled fails. The default backend (inductor, the users' default) runs under
ds_mirrored and ds_parameter_server. ds_pipeline and ds_model_parallel use ``aot_eager``: it captures the same graphs
(dynamo) and splits them into the same forward and backward (AOTAutograd) as inductor, skipping only inductor's C++
code generation, about 15 s of gcc per new graph on 2 cores; what those strategies add (which graphs are compiled
and how they meet the stages) does not depend on the backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from tests.helpers import compile_runs
from tests.helpers.runner import run_module, run_ranks

ATOL = 1e-5
AOT = "aot_eager"  # see the module docstring


def _launch(root: Path, runs: list[dict[str, Any]], ranks: int, timeout: float = 240) -> Path:
    """Run ``runs`` in one set of processes (``ranks`` started together, or one that launches or needs no others)."""
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"out": str(root), "runs": runs}))
    module, args = "tests.helpers.compile_runs", [str(spec)]
    run = run_ranks(module, args, ranks, timeout=timeout) if ranks > 1 else run_module(module, args, timeout=timeout)
    assert run.returncode == 0, run.output[-6000:]
    return root


def _params(root: Path, name: str) -> dict[str, torch.Tensor]:
    path = root / f"{name}.pt"
    errors = sorted(root.glob(f"{name}.rank*.error.txt"))
    assert path.exists(), f"{name} wrote no parameters: {[e.read_text() for e in errors]}"
    return torch.load(path)


def _record(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / f"{name}.json").read_text())


def _assert_same(root: Path, compiled: str, eager: str) -> None:
    """``compiled`` compiled at least one graph, and its parameters equal ``eager``'s within ``ATOL``."""
    assert _record(root, compiled)["graphs"] >= 1, f"{compiled} compiled nothing: the parity would say nothing"
    assert _record(root, eager)["graphs"] == 0
    expected = _params(root, eager)
    got = _params(root, compiled)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert_close(got[name], value, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{compiled} vs {eager}, {n}: {m}")


def _assert_differs(root: Path, one: str, other: str) -> None:
    """The control: a run one step shorter is caught by the same tolerance."""
    a, b = _params(root, one), _params(root, other)
    with pytest.raises(AssertionError):
        for name, value in a.items():
            assert_close(b[name], value, atol=ATOL, rtol=0)


def _refusal(root: Path, name: str, ranks: int) -> list[str]:
    assert not (root / f"{name}.pt").exists()
    return [(root / f"{name}.rank{r}.error.txt").read_text() for r in range(ranks)]


# --- ds_mirrored: one set of 2 processes for every pair ------------------------------------------------------------

_PSGD = {"gradient_compression": "powersgd", "powersgd_start_iter": 0}
_AUTO = {"gradient_compression": "auto", "powersgd_start_iter": 1}
MIRRORED: dict[str, dict[str, Any]] = {
    "plain": {},
    "powersgd": {"options": _PSGD},
    "fp16": {"options": {"gradient_compression": "fp16"}},
    "auto": {"options": _AUTO, "slow_link": True},  # auto decides on a slow link's figures: it compresses
    "bf16-mixed": {"precision": "bf16-mixed"},
}


@pytest.fixture(scope="module")
def compile_mirrored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs: list[dict[str, Any]] = [{"name": "eager_short", "strategy": "ds_mirrored", "max_steps": 2}]
    for case, extra in MIRRORED.items():
        runs.append({"name": f"eager_{case}", "strategy": "ds_mirrored", **extra})
        runs.append({"name": f"compiled_{case}", "strategy": "ds_mirrored", "compile": "module", **extra})
    # A compiled submodule is a different graph: aot_eager spares another inductor compile (module docstring).
    runs.append({"name": "compiled_submodule", "strategy": "ds_mirrored", "compile": "submodule", "backend": AOT})
    return _launch(tmp_path_factory.mktemp("compile_mirrored"), runs, ranks=2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(MIRRORED))
def test_ds_mirrored_compiled_model_steps_as_eager(compile_mirrored: Path, case: str) -> None:
    """``trainer.fit(torch.compile(model))`` (inductor) under each compression and precision equals the eager run."""
    _assert_same(compile_mirrored, f"compiled_{case}", f"eager_{case}")


@pytest.mark.multiprocess
def test_ds_mirrored_compression_ran_on_the_compiled_model(compile_mirrored: Path) -> None:
    # The hooks changed the training (so they ran on the compiled model's gradients), and auto chose to compress, the
    # same choices in both runs (so their parity compares like with like).
    for case in ("powersgd", "fp16"):
        _assert_differs(compile_mirrored, f"compiled_{case}", "eager_plain")
    eager, compiled = (_record(compile_mirrored, name)["auto_choices"] for name in ("eager_auto", "compiled_auto"))
    assert eager == compiled and compiled[-1] != "none", (eager, compiled)


@pytest.mark.multiprocess
def test_ds_mirrored_compiled_submodule_steps_as_eager(compile_mirrored: Path) -> None:
    """``self.net = torch.compile(self.net)``: DDP wraps the LightningModule around the compiled part."""
    _assert_same(compile_mirrored, "compiled_submodule", "eager_plain")


@pytest.mark.multiprocess
def test_the_parity_check_catches_one_step_fewer(compile_mirrored: Path) -> None:
    _assert_differs(compile_mirrored, "eager_short", "eager_plain")


# --- ds_pipeline and ds_model_parallel: the stages ------------------------------------------------------------------


def _stage_runs(strategy: str) -> list[dict[str, Any]]:
    """Eager, one step fewer, the compiled model, and a compiled ``net`` (refused), 2 micro-batches a batch."""
    base = {"strategy": strategy, "options": {"n_microbatches": 2}}
    return [
        {"name": "eager", **base},
        {"name": "eager_short", **base, "max_steps": 2},
        {"name": "compiled", **base, "compile": "module", "backend": AOT},
        {"name": "compiled_submodule", **base, "compile": "submodule", "backend": AOT},
    ]


@pytest.mark.multiprocess
def test_ds_pipeline_compiles_each_stage_and_refuses_a_compiled_pipe_module(tmp_path: Path) -> None:
    root = _launch(tmp_path, _stage_runs("ds_pipeline"), ranks=2)
    _assert_same(root, "compiled", "eager")
    # Rank 0's stage and the loss in training_step: the stage ran compiled in torch's schedule.
    assert _record(root, "compiled")["graphs"] == 2
    _assert_differs(root, "eager_short", "eager")
    for error in _refusal(root, "compiled_submodule", 2):
        assert error.startswith("ValueError: ds_pipeline cuts `CompileNet.net` into stages")
        assert "trainer.fit(torch.compile(model))" in error and "drop torch.compile on `net`" in error


@pytest.mark.multiprocess
def test_ds_model_parallel_compiled_model_steps_as_eager_and_a_compiled_net_is_refused(tmp_path: Path) -> None:
    root = _launch(tmp_path, _stage_runs("ds_model_parallel"), ranks=1)
    _assert_same(root, "compiled", "eager")
    _assert_differs(root, "eager_short", "eager")
    (error,) = _refusal(root, "compiled_submodule", 1)
    assert error.startswith("ValueError: ds_model_parallel cuts `CompileNet.net` into stages")
    assert "its compiled training_step runs every stage" in error


# --- ds_parameter_server: a launch per fit (its servers leave after one) ---------------------------------------------


@pytest.mark.multiprocess
def test_ds_parameter_server_compiled_model_steps_as_eager(tmp_path: Path) -> None:
    """2 workers in bulk-synchronous steps (deterministic) and 1 server; inductor compiles the workers' step."""
    ps: dict[str, Any] = {"strategy": "ds_parameter_server", "options": {"max_staleness": 0, "num_servers": 1}}
    _launch(tmp_path, [{"name": "eager", **ps}], ranks=1)
    _launch(tmp_path, [{"name": "compiled", **ps, "compile": "module"}], ranks=1)
    _assert_same(tmp_path, "compiled", "eager")
    # The control, in this process (no launch): the same tolerance tells 3 steps of this model from 2.
    spec = tmp_path / "control.json"
    single = [{"name": f"single_{n}", "strategy": "single", "max_steps": n} for n in (2, 3)]
    spec.write_text(json.dumps({"out": str(tmp_path), "runs": single}))
    compile_runs.main(str(spec))
    _assert_differs(tmp_path, "single_2", "single_3")
