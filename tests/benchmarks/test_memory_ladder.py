"""The memory benchmark's large-model pieces without heavy runs: the ladder and its outcome logic, the cgroup helpers
(a real capped cgroup only where this runs as root with cgroup v1), the readings of a climb and of the checkpoint
saves, the activation meter's parameter filter, and the ladder's and checkpoint's sections of the page."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks import harness
from benchmarks.harness.writers import write_json
from benchmarks.memory import cgroup, meters
from benchmarks.memory.driver import Memory
from benchmarks.memory.ladder import RUNGS, climb, largest, outcome, rung_shape, tied_gpt_parameters
from benchmarks.memory.modes import MODES, arm_name, mode_of
from benchmarks.memory.readings import checkpoint_reading, ladder_reading
from benchmarks.pipeline.worker import ActivationMeter
from ds_lightning.demos import TiedGPT


@pytest.mark.parametrize(("d_model", "n_layer", "block"), [(64, 2, 32), (128, 3, 64)])
def test_tied_gpt_parameters_counts_what_the_model_holds(d_model: int, n_layer: int, block: int):
    model = TiedGPT(n_layer=n_layer, n_head=2, d_model=d_model, block_size=block)
    assert tied_gpt_parameters(d_model, n_layer, block) == sum(p.numel() for p in model.parameters())


def test_ladder_grows_by_at_most_sixty_percent_a_rung_from_the_first_climbed_and_heads_divide_the_width():
    sizes = [tied_gpt_parameters(d, n, 64) for d, n in RUNGS]
    steps = [b / a for a, b in itertools.pairwise(sizes)]
    assert all(s > 1.1 for s in steps) and all(s <= 1.6 for s in steps[3:])  # climbs start at rung 4
    for i in range(len(RUNGS)):
        shape = rung_shape(i, 64)
        assert shape["d_model"] % shape["n_head"] == 0 and shape["block_size"] == 64


def test_largest_and_outcome():
    finished = [{"rung": 3, "parameters": 30}, {"rung": 5, "parameters": 70}, {"rung": 4, "parameters": 50}]
    assert largest(finished) == {"rung": 5, "parameters": 70}
    assert largest([]) is None
    # an OOM kill explains the others' failure; then a timeout; then the first failed rank; else the ladder's end
    assert outcome([-9, 1, None], [1, 0, 0], timed_out=False, ladder_done=False) == "oom-killed (rank 0)"
    assert outcome([None, None], [0, 0], timed_out=True, ladder_done=False) == "timeout"
    assert outcome([0, 1], [0, 0], timed_out=False, ladder_done=False) == "error (rank 1, exit 1)"
    assert outcome([0, 0], [0, 0], timed_out=False, ladder_done=True) == "top"


def test_cgroup_text_parsers():
    text = "9:name=systemd:/\n4:memory:/process_api/abc\n0::/\n"
    assert cgroup.memory_cgroup_of(text) == "/process_api/abc"
    assert cgroup.memory_cgroup_of("0::/user.slice\n") is None
    assert cgroup.oom_kills_of("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n") == 2
    assert cgroup.oom_kills_of("oom_kill_disable 0\nunder_oom 0\n") == 0


def test_rank_groups_make_one_capped_group_per_rank_and_wrap_a_command(tmp_path: Path, monkeypatch):
    own = cgroup.memory_cgroup_of(Path("/proc/self/cgroup").read_text())
    if own is None:
        pytest.skip("no v1 memory line in /proc/self/cgroup")
    fake_own = tmp_path / own.lstrip("/")
    fake_own.mkdir(parents=True)
    with cgroup.RankGroups(2, 123 << 20, root=tmp_path) as groups:
        assert [g.name for g in groups.groups] == ["rank0", "rank1"]
        assert (groups.groups[1] / "memory.limit_in_bytes").read_text() == str(123 << 20)
        for g in groups.groups:
            (g / "memory.oom_control").write_text("oom_kill_disable 0\noom_kill 0\n")
        assert groups.oom_kills() == [0, 0]
        # the wrapped command writes its own pid into the group's procs file, then runs the command in its place
        done = subprocess.run(groups.wrap(1, ["sh", "-c", "echo $$"]), capture_output=True, text=True, check=True)
        assert (groups.groups[1] / "cgroup.procs").read_text().strip() == done.stdout.strip()


def test_checkpoint_and_ladder_readings():
    ranks = [{"rank": r, "param_bytes": 100, "state_bytes": 200, "grad_bytes_local": 100} for r in range(2)]
    saves = [
        {"kind": "sharded", "disk_bytes": 2e6, "ranks": [{"rank": 0, "seconds": 0.5, "growth_bytes": 330}]},
        {"kind": "full", "disk_bytes": None, "ranks": [{"rank": 0, "seconds": 1, "growth_bytes": 0, "error": "E"}]},
    ]
    out = checkpoint_reading({"saves": saves}, ranks)
    # the model: (100 + 200) x 2 ranks = 600 bytes; 1/N of it 300; the growth 330 is 1.1x that
    assert out["ckpt_sharded_growth_ratio"] == pytest.approx(1.1) and out["ckpt_sharded_disk_mb"] == 2.0
    assert out["ckpt_full_error"] == "E" and "ckpt_full_s" not in out
    assert checkpoint_reading({"unavailable": "not available yet: X"}, ranks) == {
        "ckpt_unavailable": "not available yet: X"
    }
    finished = [
        {"rung": 4, "parameters": 5e6, "d_model": 320, "n_layer": 4, "peak_rss_mb_ranks": [500, 510]},
        {"rung": 5, "parameters": 7e6, "d_model": 384, "n_layer": 4, "peak_rss_mb_ranks": [550, 560]},
    ]
    climbed = {"finished": finished, "outcome": "oom-killed (rank 1)", "seconds": 9, "cgroup_peak_bytes": [2**20]}
    got = ladder_reading(climbed)
    assert got["largest_parameters"] == 7e6 and got["largest_peak_rss_mb"] == 560
    assert got["largest_shape"] == "d_model 384, 4 layers" and got["stopped"] == "oom-killed (rank 1)"
    assert ladder_reading({**climbed, "finished": []})["largest_parameters"] is None


def test_activation_meter_leaves_parameters_and_their_views_out():
    layer = nn.Linear(8, 4)
    meter = ActivationMeter()
    x = torch.randn(3, 8, requires_grad=True)
    assert meters.is_parameter(layer.weight) and meters.is_parameter(layer.weight.t())
    assert not meters.is_parameter(x * 2)
    with meters.counting_activations(meter):
        y = torch.relu(layer(x))
    # the input (3 x 8) and the ReLU's output (3 x 4) are saved; the weight is not
    assert meter.peak == 4 * (3 * 8 + 3 * 4)
    y.sum().backward()


def test_peak_rss_resets_and_status_fields():
    assert meters.status_kib("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n", "VmHWM") == 2048
    if not meters.reset_peak_rss():
        return  # /proc/self/clear_refs refused: the benchmark then reports no growth, which the readings test covers
    rss = meters.rss_kib()  # read first: the peak read after it is at least every resident set before it
    assert meters.rss_kib("VmHWM") >= rss > 0
    touched = torch.ones(64 << 18)  # 64 MiB written, so resident: the peak rises by about that much
    del touched
    meters.malloc_trim()
    raised = meters.rss_kib("VmHWM")
    assert raised >= rss + (48 << 10)
    assert meters.reset_peak_rss() and meters.rss_kib("VmHWM") < raised - (32 << 10)  # the reset brought it down


def test_modes_round_trip_their_arm_names():
    for mode in MODES:
        assert mode_of(arm_name(mode, 4)) == mode
    assert arm_name("zero", 2) == "sharded_p2"  # the name the docs read


WORKER = """
import json, os, sys
from pathlib import Path
spec = json.loads(Path(sys.argv[1]).read_text())
if os.environ["LOCAL_RANK"] == "0":
    Path(spec["out_dir"], "rungs.jsonl").write_text(json.dumps({"rung": 0, "parameters": 1}) + "\\n")
    block = bytearray(200 << 20)  # past the 64 MiB cap: the OOM killer ends this rank
"""


@pytest.mark.skipif(cgroup.unavailable_reason() is not None, reason=str(cgroup.unavailable_reason()))
def test_climb_stops_at_an_oom_kill_without_waiting_for_the_other_ranks(tmp_path: Path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER + "import time\ntime.sleep(60)\n")  # rank 1 would wait a minute: the climb must not
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    found = climb(worker, {"rungs": [0, 1]}, 2, 64 << 20, timeout=30, env=env)
    assert found["outcome"] == "oom-killed (rank 0)"
    assert found["finished"] == [{"rung": 0, "parameters": 1}]
    assert found["seconds"] < 20


def _ladder_data(tmp_path: Path) -> dict[str, Any]:
    bench = Memory()
    opts = harness.cli.resolve(bench, harness.cli.parser(bench).parse_args(["--model", "gpt", "--out", str(tmp_path)]))
    meta = bench.meta(opts)
    meta["cgroup_unavailable"] = None
    records = []
    sizes = {"plain": [10.8e6] * 3, "zero3": [39.6e6, 39.6e6, 32.1e6]}
    for mode, values in sizes.items():
        for rep, size in enumerate(values):
            found = {
                "finished": [{"rung": 9, "parameters": size, "d_model": 1, "n_layer": 1, "peak_rss_mb_ranks": [1]}]
            }
            found.update(outcome="oom-killed (rank 0)", seconds=5, cgroup_peak_bytes=[500 << 20])
            reading = ladder_reading(found)
            records.append({"arm": f"ladder_{arm_name(mode, 4)}", "repeat": rep, "part": "ladder", **reading})
    settings = {k: v for k, v in vars(opts).items() if k not in ("out", "render")}
    settings.update(parts=["ladder"])
    arms = {f"ladder_{arm_name(m, 4)}": f"{MODES[m].title}, 4 procs" for m in sizes}
    return {"benchmark": "memory", "settings": settings, **meta, "arms": {}, "ladder_arms": arms, "records": records}


def test_ladder_section_and_its_verdict(tmp_path: Path):
    pytest.importorskip("matplotlib")
    data = _ladder_data(tmp_path)
    write_json(tmp_path / "memory_gpt.json", data)
    harness.main(Memory(), ["--render", str(tmp_path / "memory_gpt.json")])
    md = (tmp_path / "memory_gpt.md").read_text()
    assert "## The largest TiedGPT under a per-process cap" in md
    assert "| ZeRO-3, 4 procs | 39.6 [32.1 - 39.6] | 3.67 [2.97 - 3.67] |" in md
    (verdict,) = Memory().summarise(data)["verdicts"]
    assert verdict["what"].startswith("ZeRO-3: largest TiedGPT under the 500 MiB cap / plain's (parameters)")
    assert verdict["target"] == ">= 3.00x" and verdict["verdict"] == "met" and verdict["launches"] == 3
    assert json.loads((tmp_path / "memory_gpt.json").read_text())["format"] == harness.FORMAT
    assert sys.modules["benchmarks.memory.ladder"].RUNGS == RUNGS


def test_checkpoint_section_and_its_verdicts_read_the_larger_model_arms(tmp_path: Path):
    """The checkpoint part's arms (the larger model) give the section's rows and the save's verdicts; a growth above
    1.10x of 1/N of the model is missed, one below it met."""
    pytest.importorskip("matplotlib")
    bench = Memory()
    opts = harness.cli.resolve(bench, harness.cli.parser(bench).parse_args(["--out", str(tmp_path)]))
    meta = bench.meta(opts)
    assert opts.parts == ["modes", "checkpoint"]
    settings = {k: v for k, v in vars(opts).items() if k not in ("out", "render")}
    settings.update(parts=["checkpoint"])
    arms = {a.name: a.title for a in bench.checkpoint_experiment(opts).arms}
    assert list(arms) == ["checkpoint_zero3_p2", "checkpoint_zero3_p4"]
    spec = bench.spec(bench.checkpoint_experiment(opts).arms[0], 0, opts)
    assert spec["hidden"] == [4096, 4096] and spec["checkpoint"] and spec["mode"] == "zero3"
    records = []
    for n, growth in ((2, 0.6), (4, 1.4)):
        model = 200e6  # bytes over every rank
        ranks = [{"rank": r, "param_bytes": model / 3 / n, "state_bytes": 2 * model / 3 / n} for r in range(n)]
        saves = [
            {"kind": k, "disk_bytes": model, "ranks": [{"rank": 0, "seconds": 1.0, "growth_bytes": g * model / n}]}
            for k, g in (("sharded", growth), ("full", 2 * n))
        ]
        for rep in range(3):
            reading = {"parameters": 17_100_000, **checkpoint_reading({"saves": saves}, ranks)}
            records.append({"arm": f"checkpoint_zero3_p{n}", "repeat": rep, "part": "checkpoint", **reading})
    data = {"benchmark": "memory", "settings": settings, **meta, "arms": {}, "ladder_arms": {}}
    data.update(checkpoint_arms=arms, records=records)
    write_json(tmp_path / "memory.json", data)
    harness.main(Memory(), ["--render", str(tmp_path / "memory.json")])
    md = (tmp_path / "memory.md").read_text()
    assert "## Checkpoint saves (ZeRO-3, a larger model)" in md and "17,100,000 parameters" in md
    assert "| ZeRO-3, larger model, 4 procs | sharded | 200.0 | 1.000 | 70.00 | 1.40 | 200.0 |" in md
    verdicts = {v["what"].rsplit(", ", 1)[1]: v["verdict"] for v in Memory().summarise(data)["verdicts"]}
    assert verdicts == {"2 processes": "met", "4 processes": "missed"}
