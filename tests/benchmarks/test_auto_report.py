"""The auto arm's shared reading (benchmarks/mirrored/auto.py): what a worker records of auto's decisions, and how the
reports count the timed steps under each choice, the probes among them, and the choices over runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.mirrored.auto import auto_reading, choice_text, choices, probes_in, timed_choices, trail
from ds_lightning.comm.auto import AllReduceFit, AutoDecision, LinkFigures

FIGURES = LinkFigures(
    world_size=2,
    float32=AllReduceFit(latency_s=50e-6, bandwidth=1.2e9),
    float16=AllReduceFit(latency_s=50e-6, bandwidth=0.4e9),
    compress_s={"fp16": 1e-3, "powersgd": 2e-3},
)


def _decision(step: int, choice: str, previous: str, probed: bool, step_s: float | None) -> AutoDecision:
    return AutoDecision(step, choice, previous, probed, FIGURES, {"none": 0.010, "fp16": 0.012}, step_s)


def test_a_workers_reading_holds_every_decision_and_the_last_figures():
    auto = SimpleNamespace(
        choice="powersgd",
        step=12,
        interval=4,
        start_iter=2,
        decisions=[_decision(0, "none", "none", True, None), _decision(2, "powersgd", "none", False, 0.02)],
        figures=FIGURES,
    )
    reading = auto_reading(SimpleNamespace(auto_compression=auto))
    assert reading is not None
    assert (reading["choice"], reading["steps"], reading["interval"], reading["start_iter"]) == ("powersgd", 12, 4, 2)
    first, second = reading["decisions"]
    assert (first["step"], first["choice"], first["probed"], first["step_ms"]) == (0, "none", True, None)
    assert second["predicted_ms"] == pytest.approx({"none": 10.0, "fp16": 12.0})
    assert (second["previous"], second["step_ms"]) == ("none", pytest.approx(20.0))
    assert reading["figures"]["float32"]["bandwidth"] == 1.2e9
    assert auto_reading(SimpleNamespace(auto_compression=None)) is None
    assert auto_reading(object()) is None  # another strategy: no auto


def _reading(decisions: list[tuple[int, str, bool]], choice: str, bandwidth: float = 1.2e9) -> dict[str, Any]:
    figures = FIGURES.as_dict()
    figures["float32"] = {**figures["float32"], "bandwidth": bandwidth}
    return {
        "choice": choice,
        "decisions": [{"step": s, "choice": c, "probed": p} for s, c, p in decisions],
        "figures": figures,
    }


def test_timed_steps_are_counted_under_the_choice_in_force_and_probes_only_inside_them():
    r = _reading([(0, "none", True), (3, "powersgd", False), (6, "powersgd", True), (9, "fp16", True)], "fp16")
    # warm-up 2, 10 steps in all: steps 2..9; none at 2, powersgd at 3..8, fp16 at 9.
    assert timed_choices(r, 2, 10) == {"none": 1, "powersgd": 6, "fp16": 1}
    assert probes_in(r, 2, 10) == 2  # steps 6 and 9; the set-up probe at step 0 never counts
    assert probes_in(r, 7, 9) == 0
    assert trail(r, limit=2) == "step 0: none (probed), step 3: powersgd, 2 more"


def test_choices_over_runs_count_final_choices_timed_steps_and_link_figures():
    runs = [
        _reading([(0, "none", True), (1, "powersgd", False)], "powersgd", 1.0e8),
        _reading([(0, "none", True), (1, "powersgd", False)], "powersgd", 1.2e8),
        _reading([(0, "none", True)], "none", 1.4e8),
        None,  # a run that recorded nothing
    ]
    c = choices(runs, 2, 7)
    assert c["runs"] == 3 and c["final"] == {"powersgd": 2, "none": 1}
    assert c["timed_steps"] == {"powersgd": 10, "none": 5}
    assert c["bandwidth_mb_s"]["median"] == pytest.approx(120.0) and c["latency_us"]["median"] == pytest.approx(50.0)
    text = choice_text(c)
    assert text.startswith("chose powersgd in 2 of 3 runs, none in 1 of 3 runs (timed steps: powersgd 10, none 5)")
    assert "bandwidth 120 [100 - 140] MB/s float32" in text and "step 1: powersgd" in text
    assert choice_text(choices([], 2, 7)) == "no auto reading"
