"""gradient_compression="auto": the cost model (no processes), the probe and forced switches on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from ds_lightning.comm import CompressionOptions, GradientCompressor
from ds_lightning.comm.auto import AllReduceFit, LinkFigures, Workload, choose, fit_line
from ds_lightning.comm.compression import get
from ds_lightning.comm.compression.powersgd import PowerSGD
from tests.comm.wire_workers import expected_powersgd_bytes
from tests.helpers import auto_workers
from tests.helpers.runner import free_port


def _work(gradient_bytes: int, powersgd_bytes: int, buckets: int) -> Workload:
    """What a step sends: the gradient under none, half of it under fp16, ``powersgd_bytes`` under PowerSGD."""
    sent = {"none": gradient_bytes, "fp16": gradient_bytes / 2, "powersgd": powersgd_bytes}
    return Workload(gradient_bytes, sent, buckets)


# A 10M-parameter MLP's gradient (40 MB) and PowerSGD rank 4's share of it, over two ranks.
WORK = _work(gradient_bytes=40_000_000, powersgd_bytes=400_000, buckets=2)
EVERY = ("none", "fp16", "powersgd")
NO_POWERSGD = ("none", "fp16")  # PowerSGD's warm-up not over
COMPUTE = {"fp16": 0.004, "powersgd": 0.02}


def _link(latency_s: float, bandwidth: float, half_bandwidth: float | None = None) -> LinkFigures:
    return LinkFigures(
        2, AllReduceFit(latency_s, bandwidth), AllReduceFit(latency_s, half_bandwidth or bandwidth), COMPUTE
    )


LOOPBACK = _link(20e-6, 3e9, half_bandwidth=0.5e9)  # gloo sums halves slowly: fp16 loses on loopback
MBIT_100 = _link(200e-6, 12.5e6)
GBIT_1 = _link(100e-6, 125e6)


# --- the cost model ---------------------------------------------------------------------------------------------


def test_ring_formula():
    fit = AllReduceFit(latency_s=1e-3, bandwidth=1e6)
    # 4 ranks: 6 rounds of latency, 2 * 3/4 of the bytes through each link.
    assert fit.seconds(1_000_000, 4) == pytest.approx(6e-3 + 1.5)
    assert fit.seconds(1_000_000, 4, collectives=3) == pytest.approx(18e-3 + 1.5)
    assert fit.seconds(1_000_000, 1) == 0.0


@pytest.mark.parametrize(("link", "expected"), [(LOOPBACK, "none"), (GBIT_1, "powersgd"), (MBIT_100, "powersgd")])
def test_the_fastest_predicted_candidate_wins(link, expected):
    made = choose(link, WORK, current="none", step_s=0.05, allowed=EVERY)
    assert made.name == expected, made
    assert set(made.predicted_s) == {"none", "fp16", "powersgd"}
    assert made.predicted_s[expected] == min(made.predicted_s.values())


def test_powersgd_waits_for_its_warm_up_and_fp16_stands_in():
    early = choose(MBIT_100, WORK, current="none", step_s=None, allowed=NO_POWERSGD)
    assert early.name == "fp16" and "powersgd" not in early.predicted_s
    later = choose(MBIT_100, WORK, current="fp16", step_s=1.8, allowed=EVERY)
    assert later.name == "powersgd"


def test_compute_is_the_step_minus_the_running_choices_communication():
    step_s = 4.0
    made = choose(MBIT_100, WORK, current="none", step_s=step_s, allowed=EVERY)
    assert made.compute_s == pytest.approx(step_s - get("none").comm_seconds(MBIT_100, WORK))
    assert made.predicted_s["none"] == pytest.approx(step_s)


def test_compression_must_save_the_margin_and_none_returns_when_it_does_not():
    # A tiny model on a fast link: fp16 saves a sliver of a long step, under the margin: none stays, and a running
    # compression gives way to none as soon as the link no longer pays for it.
    tiny = _work(gradient_bytes=40_000, powersgd_bytes=4_000, buckets=1)
    fast = LinkFigures(2, AllReduceFit(20e-6, 3e9), AllReduceFit(20e-6, 1e10), {"fp16": 0.0, "powersgd": 0.0})
    made = choose(fast, tiny, current="none", step_s=0.02, allowed=EVERY)
    assert made.name == "none" and made.predicted_s["fp16"] < made.predicted_s["none"], made
    assert choose(fast, tiny, current="powersgd", step_s=0.02, allowed=EVERY).name == "none"


def test_between_compressions_the_current_one_stays_unless_another_saves_the_margin():
    # Slow link: both compressions save most of the step; PowerSGD is a little faster than fp16, not by the margin.
    link = LinkFigures(2, AllReduceFit(1e-4, 1e7), AllReduceFit(1e-4, 1e7), {"fp16": 0.0, "powersgd": 0.0})
    work = _work(gradient_bytes=1_000_000, powersgd_bytes=490_000, buckets=1)
    made = choose(link, work, current="fp16", step_s=None, allowed=EVERY)
    assert made.predicted_s["powersgd"] < made.predicted_s["fp16"] and made.name == "fp16", made
    assert choose(link, work, current="none", step_s=None, allowed=EVERY).name == "powersgd"


def test_the_users_rank_is_a_floor_auto_never_lowers():
    # Bytes are costed at exactly the rank given; a higher rank costs more and a lower one is not a candidate.
    shapes = [(256, 64), (256,), (10, 256)]

    def sent(shapes: list[tuple[int, ...]], rank: int) -> float:
        return PowerSGD(CompressionOptions(powersgd_rank=rank)).sent_bytes(shapes)

    assert sent(shapes, 16) == 4 * ((256 + 64) * 16 + 256 + 10 * 256)
    assert sent(shapes, 4) == 4 * ((256 + 64) * 4 + 256 + (10 + 256) * 4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 10))
    params = [tuple(p.shape) for p in model.parameters()]
    assert sent(params, 2) == expected_powersgd_bytes(model, rank=2)


def test_fit_line_recovers_latency_and_bandwidth():
    true = AllReduceFit(latency_s=50e-6, bandwidth=20e6)
    sizes = [4096.0, 131072.0, 1048576.0]
    fit = fit_line(sizes, [true.seconds(s, 3) for s in sizes], 3)
    assert fit.latency_s == pytest.approx(true.latency_s, rel=1e-6)
    assert fit.bandwidth == pytest.approx(true.bandwidth, rel=1e-6)
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_line([4096.0, 4096.0], [1.0, 2.0], 2)


def test_figures_round_trip_as_plain_numbers():
    assert LinkFigures.from_dict(MBIT_100.as_dict()) == MBIT_100


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "500"])
def test_bad_auto_interval_names_the_value_and_the_fix(value):
    with pytest.raises(ValueError, match=rf"auto_interval={value!r}.*auto_interval=500"):
        GradientCompressor("auto", auto_interval=value)


# --- real gloo ranks ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One pair of gloo processes: the probe, then the forced switches (results per rank)."""
    out = tmp_path_factory.mktemp("auto") / "run"
    mp.spawn(auto_workers.probe_then_switch, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return {
        kind: [torch.load(f"{out}.{kind}.rank{r}.pt", weights_only=True) for r in (0, 1)]
        for kind in ("probe", "switch")
    }


@pytest.mark.multiprocess
def test_probe_on_loopback_gives_positive_figures_identical_on_both_ranks(two_ranks):
    rank0, rank1 = two_ranks["probe"]
    assert rank0["figures"] == rank1["figures"]  # the slowest rank's times, agreed by all-reduce
    for figures in rank0["figures"]:
        assert figures["world_size"] == 2
        for path in ("float32", "float16"):
            assert figures[path]["latency_s"] > 0 and figures[path]["bandwidth"] > 0, figures
        assert set(figures["compress_s"]) == {"fp16", "powersgd"}
        assert all(seconds > 0 for seconds in figures["compress_s"].values()), figures
        # The agreed compute figure is the maximum over ranks: never below this rank's own.
        for name, local in rank0["local_compute"].items():
            assert figures["compress_s"][name] >= local


@pytest.mark.multiprocess
def test_forced_switches_keep_every_rank_on_rank_zeros_choice(two_ranks):
    rank0, rank1 = two_ranks["switch"]
    assert rank0["buckets"] > 1  # several buckets: the re-decision happened at a step's first one
    # Rank 0 saw slow, fast, slow figures (8 steps each), rank 1 the opposite: both ran rank 0's choice.
    expected = ["fp16"] * 2 + ["powersgd"] * 2 + ["none"] * 8 + ["powersgd"] * 8
    assert rank0["choices"][4:] == rank1["choices"][4:] == expected, rank0["decisions"]
    assert rank0["decisions"] == rank1["decisions"]
    decided = [(step, choice, probed) for step, choice, _, probed in rank0["decisions"][1:]]
    assert decided == [
        (4, "fp16", True),
        (6, "powersgd", False),  # the warm-up ended: decided on the last figures, no probe
        (8, "none", True),
        (12, "none", True),
        (16, "powersgd", True),
        (20, "powersgd", True),
    ]
    assert rank0["dtypes"] == ["torch.float16", "torch.float32"]
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(a, b)  # every rank applied the same averaged gradient at every step
    losses = rank0["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) < sum(losses[:4])  # training went on through every switch
    state = rank0["state"]
    assert state["name"] == "auto" and state["choice"] == "powersgd" and state["step"] == 24
    assert state["powersgd"]["error"]  # PowerSGD's error feedback, checkpointed with the choice
