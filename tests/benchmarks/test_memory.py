"""The memory benchmark's broadcast count (by hand, and against what torch's ZeroRedundancyOptimizer really
broadcasts), its reading of fabricated digits and GPT results, and the worker's reading of one process per mode.
The ladder, cgroup and checkpoint pieces: ``test_memory_ladder.py``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from benchmarks import harness
from benchmarks.harness.cli import parser, resolve
from benchmarks.harness.writers import write_json
from benchmarks.memory.driver import Memory
from benchmarks.memory.modes import arm_name, arm_title
from benchmarks.memory.readings import mode_reading
from benchmarks.memory.worker import main as worker_main
from benchmarks.sharding_engines.common import broadcast_bytes, broadcasts_per_step, judged
from ds_lightning.testing import free_port


def _param(*shape: int, dtype: torch.dtype = torch.float32, trainable: bool = True) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=trainable)


def test_broadcast_bytes_counts_each_owners_parameters_by_hand():
    partition = [
        [{"params": [_param(10, 10), _param(5)]}],  # 400 + 20 bytes
        [{"params": [_param(3, dtype=torch.float64)]}, {"params": [_param(4, trainable=False)]}],  # 24 + 16
        [{"params": []}],  # owns nothing
    ]
    # one broadcast per parameter, trainable or not
    assert broadcast_bytes(partition) == [420, 40, 0]
    assert broadcasts_per_step(partition) == 4
    # parameters_as_bucket_view: one bucket per rank of its trainable parameters, one fp32 element when empty
    assert broadcast_bytes(partition, bucket_view=True) == [420, 24, 4]
    assert broadcasts_per_step(partition, bucket_view=True) == 3


def test_broadcast_bytes_match_what_zero_redundancy_optimizer_broadcasts(one_rank_group, monkeypatch):
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    sent: list[tuple[int, int]] = []
    real = dist.broadcast

    def recording(tensor: torch.Tensor, src: int, *args: Any, **kwargs: Any) -> Any:
        sent.append((src, tensor.numel() * tensor.element_size()))
        return real(tensor, src, *args, **kwargs)

    monkeypatch.setattr(dist, "broadcast", recording)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    partition = optimizer._partition_parameters()
    assert sum(b for src, b in sent if src == 0) == broadcast_bytes(partition)[0] == (6 * 5 + 5 + 5 * 3 + 3) * 4
    assert len(sent) == broadcasts_per_step(partition) == 4


@pytest.mark.parametrize(
    ("runs", "limit", "expected"),
    [
        ((0.5, 0.5, 0.5), 0.55, "met"),
        ((0.6, 0.6, 0.7), 0.55, "missed"),
        ((0.5, 0.6, 0.6), 0.55, "within noise"),
        ((1.0, 1.0, 1.0), None, "-"),
        ((0.5,), 0.55, "not judged"),
    ],
)
def test_verdict_judges_the_median_ratio_by_the_harness_rule(runs: tuple, limit: float | None, expected: str):
    (target,) = judged({"x_ratio": harness.spread(runs)}, 2, [("what", "x", limit)])
    assert target["verdict"] == expected
    assert judged({}, 2, [("what", "x", 1.0)])[0]["verdict"] == "no data"


def _opts(*argv: str) -> argparse.Namespace:
    bench = Memory()
    opts = resolve(bench, parser(bench).parse_args([*argv, "--out", "unused"]))
    bench.meta(opts)
    return opts


def _ranks(procs: int, mode: str, total_state: int, grad: float, params_bytes: int) -> list[dict[str, Any]]:
    """A run's ranks: plain, ``zero`` (an uneven partition, broadcasts), ``fsdp2`` (even shards, an all-gather of
    the rank's shard and a reduce-scatter of every gradient, no all-reduce) or ``zero3`` (parameters and gradients
    sharded too, gathered twice a step)."""
    zero, fsdp = mode == "zero", mode in ("fsdp2", "zero3")
    sharded = mode != "plain"
    state = [total_state // procs if sharded else total_state] * procs
    bcast = [params_bytes // procs if zero else 0] * procs
    if zero:  # an uneven partition: rank 0 holds more
        state[0] += 1000
        bcast[0] += 250
    held = params_bytes // procs if mode == "zero3" else params_bytes
    grads = params_bytes // procs if fsdp else params_bytes
    return [
        {
            "rank": r,
            "optimizer_class": "ZeroRedundancyOptimizer" if zero else "Adam",
            "state_bytes": state[r],
            "param_bytes": held,
            "grad_bytes_local": grads,
            "activation_bytes": 500_000,
            "allreduce_bytes": 0.0 if fsdp else grad,
            "broadcast_bytes": bcast[r],
            "broadcast_calls": 6 if zero else 0,
            "allgather_bytes": (params_bytes // procs) * (2 if mode == "zero3" else 1) if fsdp else 0,
            "reducescatter_bytes": params_bytes if fsdp else 0,
            "peak_rss_mb": 300.0 + r,
        }
        for r in range(procs)
    ]


MODES = ("plain", "zero", "fsdp2", "zero3")
LFSDP_ERROR = "exit code 1, ValueError: The strategy `fsdp` requires a GPU accelerator"


def _data(model: str) -> dict[str, Any]:
    opts = _opts("--model", model, "--parts", "modes", "--no-checkpoint", "--external", "lightning_fsdp")
    opts.modes = list(MODES)
    params = 1_000_000
    records = []
    runs = [(p, m) for p in (2, 4) for m in MODES]
    for i, (rep, (procs, mode)) in enumerate((rep, run) for rep in range(3) for run in runs):
        ranks = _ranks(procs, mode, 8 * params + 24, 4.0 * params, 4 * params)
        result = {"median_step_ms": 100.0 * (1.05 if mode != "plain" else 1.0), "ranks": ranks, "parameters": params}
        arm = arm_name(mode, procs)
        records.append({"arm": arm, "repeat": rep, "order": i, "seconds": 20.0, "rc": 0, **mode_reading(result)})
    records += [{"arm": arm_name("lightning_fsdp", p), "repeat": 0, "error": LFSDP_ERROR} for p in (2, 4)]
    settings = {k: v for k, v in vars(opts).items() if k not in ("out", "render")}
    arms = {arm_name(m, p): arm_title(m, p) for p in (2, 4) for m in (*MODES, "lightning_fsdp")}
    meta = Memory().meta(opts)
    return {"benchmark": "memory", "settings": settings, **meta, "arms": arms, "ladder_arms": {}, "records": records}


@pytest.mark.parametrize(("model", "stem"), [("digits", "memory"), ("gpt", "memory_gpt")])
def test_render_writes_the_workloads_files_with_each_target_and_the_bytes_ratio(tmp_path: Path, model: str, stem: str):
    pytest.importorskip("matplotlib")
    write_json(tmp_path / f"{stem}.json", _data(model))
    harness.main(Memory(), ["--render", str(tmp_path / f"{stem}.json")])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.json", f"{stem}.md", f"{stem}.png"]
    md = (tmp_path / f"{stem}.md").read_text()
    name = "byte-level GPT (4 layers" if model == "gpt" else "digits MLP 64-1024-1024-10"
    assert md.startswith(f"# Sharding modes on the {name}")
    assert ("AdamW" in md) == (model == "gpt")
    assert "not measured on a wire" in md
    # state: 2 ranks (4,000,012 + 1000) / 8,000,024 = 0.500; 4 ranks (2,000,006 + 1000) / 8,000,024 = 0.250
    assert "| optimizer-state bytes, largest rank | 2 | 0.500 | <= 0.55x | **met** |" in md
    assert "| optimizer-state bytes, largest rank | 4 | 0.250 | <= 0.30x | **met** |" in md
    assert "| step time (rank 0's median) | 2 | 1.050 | <= 1.10x | **met** |" in md
    # bytes sent, largest rank: 2 ranks (4e6 + 2e6 + 250) / 4e6 = 1.500; 4 ranks (4e6 + 1e6 + 250) / 4e6 = 1.250
    assert "| payload bytes per step (counted), largest rank | 2 | 1.500 | <= 1.10x | **missed** |" in md
    assert "| payload bytes per step (counted), largest rank | 4 | 1.250 | <= 1.10x | **missed** |" in md
    assert "| peak RSS, largest rank (no target) | 4 | 1.000 | - | - |" in md
    assert "| payload bytes under a ring model, largest rank | 2 | 1.500 | <= 1.10x | **missed** |" in md
    # fsdp2: even halves; all-gather 2e6 + reduce-scatter 4e6 handed = 1.5x, but a ring sends 1 x 2e6 + 1/2 x 4e6
    assert "| fsdp2: optimizer-state bytes, largest rank | 2 | 0.500 | <= 0.55x | **met** |" in md
    assert "| fsdp2: payload bytes per step (counted), largest rank | 2 | 1.500 | <= 1.10x | **missed** |" in md
    assert "| fsdp2: payload bytes under a ring model, largest rank | 4 | 1.000 | <= 1.10x | **met** |" in md
    # ZeRO-3 at 4 ranks: (1e6 + 1e6 + 2,000,006) / (4e6 + 4e6 + 8,000,024) = 0.250 of plain's model state
    state = "| zero3: model state (params + grads + optimizer state), largest rank | 4 | 0.250 | <= 0.30x | **met** |"
    assert state in md
    assert "| zero3: model state (params + grads + optimizer state), largest rank | 2 | 0.500 | - | - |" in md
    # parameters, gradients, every rank's optimizer state, model state, activations, RSS, step and its ratio
    row = "| ZeRO-1 (zero), 2 procs | 4.000 | 4.000 | 4.001 / 4.000 | 12.001 | 0.50 | 301 | 105.00 | 1.05 |"
    assert row in md
    assert (
        "| ZeRO-3, 4 procs | 1.000 | 1.000 | 2.000 / 2.000 / 2.000 / 2.000 | 4.000 | 0.50 | 303 | 105.00 | 1.05 |" in md
    )
    assert "| plain, 2 procs | 4.000 | 4.000 | 8.000 / 8.000 | 16.000 | 0.50 | 301 | 100.00 | - |" in md
    # payloads: ZeRO-3 gathers twice (2 x 1e6) and scatters every gradient (4e6); a ring: 3 x 2e6 + 3/4 x 4e6
    assert "| ZeRO-3, 4 procs | 0.000 | 0.000 | 6.000 | 6.000 | 9.000 |" in md
    # Lightning's FSDPStrategy could not run: the page says why, and its arm has no targets
    assert f"- **Lightning FSDPStrategy (FULL_SHARD), 2 procs** could not run here: `{LFSDP_ERROR}`" in md
    verdicts = {v["what"]: v for v in Memory().summarise(_data(model))["verdicts"]}
    assert "zero3: model state (params + grads + optimizer state), largest rank, 4 processes" in verdicts


@pytest.mark.parametrize("mode", ["plain", "zero", "fsdp2", "zero3", "offload"])
def test_worker_reads_a_ranks_state_gradient_and_broadcast_bytes(tmp_path: Path, monkeypatch, mode: str):
    # One process only (world size 1): the figures' plumbing, counted by hand for the 64-16-10 MLP under Adam.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    spec = {"procs": 1, "mode": mode, "hidden": [16], "batch_size": 8, "steps": 2, "warmup": 1}
    spec.update(workload={"model": "digits"}, out_dir=str(tmp_path), checkpoint=mode == "zero3")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    threads = torch.get_num_threads()  # the worker pins 1 thread: give this test process its own back
    try:
        worker_main(str(tmp_path / "spec.json"))
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
    reading = mode_reading(json.loads((tmp_path / "result.json").read_text()))
    params = 64 * 16 + 16 + 16 * 10 + 10  # 1,210 fp32 parameters in 4 tensors
    assert reading["parameters"] == params
    zero, fsdp = mode == "zero", mode in ("fsdp2", "zero3", "offload")
    assert reading["optimizer_class"] == ("ZeroRedundancyOptimizer" if zero else "Adam")
    assert reading["state_bytes_ranks"] == [2 * 4 * params + 4 * 4]  # two moments, and a 4-byte step per tensor
    assert reading["model_state_bytes_ranks"] == [4 * params + 4 * params + 2 * 4 * params + 4 * 4]
    assert reading["grad_bytes"] == (0 if fsdp else 4 * params)
    assert reading["broadcast_bytes_ranks"] == [4 * params if zero else 0]
    assert reading["broadcast_calls"] == (4 if zero else 0)
    # fsdp2 on one rank: its shard is every parameter (all-gathered, twice under ZeRO-3), every gradient scattered
    gathers = 2 if mode in ("zero3", "offload") else 1
    assert reading["fsdp_bytes_max"] == ((gathers + 1) * 4 * params if fsdp else 0)
    assert reading["rss_mb_max"] > 0
    # a batch of 8: the first Linear's input (8 x 64), its output (8 x 16) and the ReLU's, and the logits at least
    assert reading["activation_mb_max"] * 1e6 >= 4 * 8 * (64 + 16 + 10)
    if mode == "zero3":  # both saves ran on the one rank, and each wrote something
        assert reading["ckpt_sharded_disk_mb"] > 0 and reading["ckpt_full_disk_mb"] > 0
        assert reading["ckpt_sharded_s"] > 0 and reading["ckpt_full_growth_ratio"] is not None


def test_full_run_keeps_every_arm_the_docs_read():
    bench = Memory()
    opts = _opts()
    arms = {a.name for a in bench.experiment(opts).arms}
    names = ("plain", "sharded", "fsdp2", "zero3", "offload", "lfsdp", "deepspeed")
    assert arms == {f"{a}_p{n}" for a in names for n in (2, 4)}
    assert opts.repeats >= harness.MIN_LAUNCHES
    assert opts.parts == ["modes", "checkpoint"] and _opts("--model", "gpt").parts == ["modes", "ladder", "checkpoint"]
    assert _opts("--no-checkpoint").parts == ["modes"]
