"""Validation, test and predict count every sample exactly once under the ds strategies, at any set size.

One launch per strategy evaluates several sizes (``tests/helpers/eval_once_workers.py``); each result is checked
against plain single-process torch. The control, Lightning's ``ddp``, pads 359 samples to 360 and counts one twice.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.eval_once_workers import make_data, make_net
from tests.helpers.runner import run_ranks

# (strategy, processes, sizes): ds_pipeline runs 2 replicas of 2 stages; a size below the replica count is refused.
RUNS = {
    "ds_mirrored": ("ds_mirrored", 2, ["--fit", "359", "360", "361", "1"]),
    "ds_parameter_server": ("ds_parameter_server", 3, ["359", "361", "2"]),
    "ds_pipeline": ("ds_pipeline", 4, ["359", "361", "1"]),
    "ddp": ("ddp", 2, ["359"]),
}
REPLICAS = {"ds_mirrored": 2, "ds_parameter_server": 3, "ds_pipeline": 2, "ddp": 2}


@cache
def reference(size: int) -> tuple[float, list[int]]:
    """One process, plain torch: the accuracy over the whole set and every sample's prediction."""
    data = make_data(size)
    with torch.no_grad():
        preds = make_net()(data.tensors[0]).argmax(-1)
    return float((preds == data.tensors[1]).float().mean()), preds.tolist()


@cache
def launch(name: str, tmp: str) -> list[dict[str, Any]]:
    strategy, ranks, sizes = RUNS[name]
    out = Path(tmp) / name
    run = run_ranks("tests.helpers.eval_once_workers", [strategy, str(out), *sizes], ranks, timeout=280)
    run.assert_every_rank_exits(0)
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(ranks)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = str(tmp_path_factory.mktemp("eval_once"))
    return lambda name: launch(name, tmp)


def check_once(ranks: list[dict[str, Any]], key: str, fn: str, size: int, stages: int = 1) -> None:
    """Every rank logged one process's accuracy and sample count, and each replica saw a disjoint share of the set.

    Under ds_pipeline the stages of a replica evaluate the same batches (``stages`` ranks in a row), so a sum across
    all ranks counts each sample once per stage; ratios (accuracy, means) are exact.
    """
    accuracy, _ = reference(size)
    seen: list[int] = []
    for rank, record in enumerate(ranks):
        entry = record[key] if fn == "fit" else record[key][fn]
        torch.testing.assert_close(entry["metrics"]["acc_metric"], accuracy, rtol=0, atol=1e-6)
        torch.testing.assert_close(entry["metrics"]["acc_mean"], accuracy, rtol=0, atol=1e-6)
        assert entry["metrics"]["samples"] == size * stages
        if rank % stages == 0:
            seen += entry["indices"]
    assert sorted(seen) == list(range(size)), (
        f"{fn} on {size}: repeated {[i for i, n in Counter(seen).items() if n > 1]}"
    )


@pytest.mark.parametrize("name", ["ds_mirrored", "ds_parameter_server", "ds_pipeline"])
def test_each_sample_once(results: Any, name: str) -> None:
    ranks = results(name)
    stages = 2 if name == "ds_pipeline" else 1
    sizes = [int(s) for s in RUNS[name][2] if s.isdigit() and int(s) >= REPLICAS[name]]
    for size in sizes:
        for fn in ("validate", "test"):
            check_once(ranks, str(size), fn, size, stages)
        # Predict returns each sample's prediction once per replica, on the rank(s) that evaluated it.
        predicted = [ranks[r][str(size)]["predict"] for r in range(0, len(ranks), stages)]
        rows = [row for p in predicted for row in zip(p["indices"], p["preds"], strict=True)]
        assert sorted(i for i, _ in rows) == list(range(size))
        assert dict(rows) == dict(enumerate(reference(size)[1]))
    if "--fit" in RUNS[name][2]:
        check_once(ranks, "fit359", "fit", 359)


@pytest.mark.parametrize("name", ["ds_mirrored", "ds_parameter_server", "ds_pipeline"])
def test_refusals_name_the_fix(results: Any, name: str) -> None:
    ranks = results(name)
    small = next(s for s in RUNS[name][2] if s.isdigit() and int(s) < REPLICAS[name])
    for record in ranks:
        for fn in ("validate", "test"):
            assert (
                "EvalShardError" in record[small][fn]["error"]
                and f"Trainer(devices={small})" in record[small][fn]["error"]
            )
        # Lightning's own predict sampler asserts on the empty rank first; the others refuse instead of waiting.
        assert record[small]["predict"]["error"].startswith(("EvalShardError", "AssertionError"))
        # 361 samples give the ranks uneven batch counts: an on_step sync would hang, so every rank refuses it.
        assert "on_step=False" in record["step_sync"], record["step_sync"]


def test_control_lightning_ddp_pads(results: Any) -> None:
    """Without the ds strategies' shards, Lightning pads 359 samples to 360: one is evaluated twice."""
    ranks = results("ddp")
    seen = [i for record in ranks for i in record["359"]["validate"]["indices"]]
    assert len(seen) == 360 and len(set(seen)) == 359
    assert ranks[0]["359"]["validate"]["metrics"]["samples"] == 360
    accuracy, _ = reference(359)
    assert abs(ranks[0]["359"]["validate"]["metrics"]["acc_metric"] - accuracy) > 1e-4
