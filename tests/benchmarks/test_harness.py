"""The benchmark harness's pure parts: the interleaved order, summaries, writers and the CLI on a toy benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness
from benchmarks.harness import Arm, Experiment, Panel


def test_interleave_alternates_arms_and_varies_each_rounds_order():
    assert harness.interleave(["A", "B"], 4) == [(i // 2, n) for i, n in enumerate("ABBABAAB")]
    assert [n for _, n in harness.interleave(["A", "B", "C"], 3)] == list("ABCCBABCA")
    assert [n for _, n in harness.interleave(["A", "B"], 2, rotate=False)] == list("ABAB")


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_round_order_varies_leader_and_neighbours(n: int):
    """Over 2n rounds every arm leads and trails, and whatever arm runs right after another also runs right before it
    in some round; a plain rotation (A B C, B C A, C A B) keeps B right after A in every round: the control."""
    arms = [chr(ord("A") + i) for i in range(n)]

    def pairs(rounds: list[list[str]]) -> set[tuple[str, str]]:
        return {(r[i], r[i + 1]) for r in rounds for i in range(n - 1)}

    rounds = [harness.round_order(arms, r) for r in range(2 * n)]
    assert all(sorted(r) == arms for r in rounds)
    assert {r[0] for r in rounds} == {r[-1] for r in rounds} == set(arms)
    assert all((b, a) in pairs(rounds) for a, b in pairs(rounds))
    rotation = [arms[r % n :] + arms[: r % n] for r in range(2 * n)]
    assert n == 2 or not all((b, a) in pairs(rotation) for a, b in pairs(rotation))  # two arms: a rotation swaps


def test_round_order_of_three_covers_every_permutation_in_six_rounds():
    orders = {"".join(harness.round_order("ABC", r)) for r in range(6)}
    assert orders == {"ABC", "ACB", "BAC", "BCA", "CAB", "CBA"}
    assert harness.round_order([], 3) == []


def _launches(*xs: float) -> dict:
    return harness.spread(xs)


@pytest.mark.parametrize(
    ("runs", "bound", "expected"),
    [
        ((1.00, 1.02, 1.04), {"at_most": 1.05}, "met"),
        ((1.03, 1.07, 1.09), {"at_most": 1.05}, "within noise"),  # median over, the spread reaches under
        ((1.06, 1.07, 1.09), {"at_most": 1.05}, "missed"),
        ((1.6, 1.7, 1.8), {"at_least": 1.5}, "met"),
        ((1.4, 1.45, 1.55), {"at_least": 1.5}, "within noise"),
        ((1.2, 1.3, 1.4), {"at_least": 1.5}, "missed"),
        ((1.00, 1.01), {"at_most": 1.05}, "not judged"),  # fewer than 3 launches
        ((), {"at_most": 1.05}, "no data"),
    ],
)
def test_verdict_rule(runs: tuple, bound: dict, expected: str):
    value = _launches(*runs)
    assert harness.verdict(value, **bound) == expected
    assert harness.is_met(value, **bound) == {"met": True, "within noise": False, "missed": False}.get(expected)


def test_verdict_needs_exactly_one_bound():
    with pytest.raises(ValueError, match="exactly one"):
        harness.verdict(_launches(1, 2, 3))
    with pytest.raises(ValueError, match="exactly one"):
        harness.verdict(_launches(1, 2, 3), at_most=1, at_least=0)


def test_judged_lists_one_target_in_one_shape_by_the_verdict_rule():
    got = harness.judged("a / b step time", _launches(1.03, 1.07, 1.09), at_most=1.05, unit="x")
    assert got == {
        "what": "a / b step time",
        "target": "<= 1.05x",
        "median": 1.07,
        "min": 1.03,
        "max": 1.09,
        "launches": 3,
        "verdict": "within noise",
    }
    assert harness.judged("speed-up", _launches(1.6, 1.7, 1.8), at_least=1.5)["target"] == ">= 1.50"
    empty = harness.judged("none ran", None, at_most=1.0)
    assert (empty["median"], empty["launches"], empty["verdict"]) == (None, 0, "no data")
    assert harness.judged("two", _launches(1.0, 1.0), at_most=1.05)["verdict"] == "not judged"
    assert harness.judged("tiny", _launches(0, 0, 0), at_most=1e-5, spec="g")["target"] == "<= 1e-05"


@pytest.mark.parametrize(
    ("runs", "holds", "expected"),
    [
        ((1.0, 1.0, 1.0), True, "met"),
        ((1.0, 1.0, 1.0), False, "missed"),  # e.g. the accuracy a long run kept fell out of bounds
        ((1.0, 1.0, 1.0), None, "no data"),  # ... or was not measured
        ((1.03, 1.07, 1.09), False, "missed"),
        ((1.03, 1.07, 1.09), None, "within noise"),
        ((1.0, 1.0), False, "not judged"),
    ],
)
def test_judged_with_a_condition_without_a_spread(runs: tuple, holds: bool | None, expected: str):
    assert harness.judged("auto", _launches(*runs), at_most=1.05, holds=holds)["verdict"] == expected


def test_verdict_lines_close_a_page_with_every_target_or_say_there_is_none():
    entry = harness.judged("a / b", _launches(0.9, 1.0, 1.2), at_most=1.1, unit="x")
    lines = harness.verdict_lines([entry])
    assert lines[1] == "## Verdicts"
    assert lines[-1] == "| a / b | <= 1.10x | 1 [0.9 - 1.2] | 3 | met |"
    assert harness.verdict_lines([])[-1].startswith("This benchmark states no target")
    assert harness.verdict_lines(None) == []  # a summary from before the verdicts list


def test_experiment_order_and_validation():
    exp = Experiment([Arm("a", {"x": 1}), Arm("b", label="B!")], repeats=2, baseline="a")
    assert [(r, a.name) for r, a in exp.order()] == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    assert exp.arm("b").title == "B!" and exp.arm("a").title == "a"
    with pytest.raises(ValueError, match="baseline='c'"):
        Experiment([Arm("a")], repeats=1, baseline="c")
    with pytest.raises(ValueError, match="repeat a name"):
        Experiment([Arm("a"), Arm("a")], repeats=1)
    with pytest.raises(ValueError, match="repeats=0"):
        Experiment([Arm("a")], repeats=0)


def test_spread_median_range_and_quartiles():
    s = harness.spread([5.0, 1.0, None, 3.0, 2.0, 4.0])
    assert s == {"median": 3.0, "min": 1.0, "max": 5.0, "q1": 2.0, "q3": 4.0, "runs": [5.0, 1.0, 3.0, 2.0, 4.0]}
    assert harness.spread([None]) is None
    assert harness.spread([7.0])["q1"] == 7.0


def _records() -> list[dict[str, Any]]:
    ms = {"fp32": (10.0, 12.0, 11.0), "bf16": (8.0, 20.0, None), "auto": (8.8, 13.2, 11.0)}  # bf16's repeat 2 failed
    return [
        {"arm": arm, "repeat": r, **({"ms": v[r]} if v[r] is not None else {"error": "exit code 1"})}
        for r in range(3)
        for arm, v in ms.items()
    ]


def test_paired_ratio_per_repeat_skips_failed_runs():
    r = harness.paired(_records(), "bf16", "fp32", "ms")
    assert r["runs"] == pytest.approx([0.8, 20 / 12])  # repeat 2's bf16 failed: no pair
    assert r["median"] == pytest.approx((0.8 + 20 / 12) / 2)


def test_paired_ratio_against_the_faster_of_several_arms():
    r = harness.paired(_records(), "auto", ["fp32", "bf16"], "ms")
    # repeat 0: bf16 (8.0) is faster; repeat 1: fp32 (12.0); repeat 2: bf16 failed, so no faster-of-both.
    assert r["runs"] == pytest.approx([8.8 / 8.0, 13.2 / 12.0])


def test_summarise_counts_failures_and_ratios_to_the_baseline():
    s = harness.summarise(_records(), ["fp32", "bf16", "auto"], ["ms"], baseline="fp32")
    assert s["bf16"]["failed_runs"] == 1 and s["bf16"]["errors"] == ["exit code 1"]
    assert s["fp32"]["ms"]["median"] == 11.0 and "ms_ratio" not in s["fp32"]
    assert s["auto"]["ms_ratio"]["runs"] == pytest.approx([0.88, 1.1, 1.0])
    assert harness.best_of(s, ["fp32", "bf16"], "ms") == "fp32"  # medians 11.0 and 14.0


def test_fmt():
    assert harness.fmt(harness.spread([1.0, 2.0, 4.0]), ".1f") == "2.0 [1.0 - 4.0]"
    assert harness.fmt(harness.spread([1.0, 2.0, 3.0, 4.0, 100.0]), ".0f", iqr=True) == "3 [2 - 4]"
    assert harness.fmt(harness.spread([0.5]), ".0f", scale=100) == "50"
    assert harness.fmt(harness.spread([1.5, 1.5, 1.5]), ".2f") == "1.50"  # a nil spread is the value alone
    assert harness.fmt(harness.spread([1.1, 1.1000000000000001, 1.1]), ".3f") == "1.100"  # nil at this precision
    assert harness.fmt(harness.spread([1.1, 1.1, 1.2]), ".2f") == "1.10 [1.10 - 1.20]"
    assert harness.fmt(None) == "-"


def test_markdown_table():
    assert harness.markdown_table(["a", "b"], [[1, "x|y"]]) == ["| a | b |", "|---|---|", "| 1 | x\\|y |"]
    with pytest.raises(ValueError, match="2 cells"):
        harness.markdown_table(["a", "b"], [[1]])


def test_json_round_trip_and_old_format_refused(tmp_path: Path):
    harness.write_json(tmp_path / "x.json", {"records": [{"arm": "a"}]})
    assert harness.read_json(tmp_path / "x.json") == {"format": harness.FORMAT, "records": [{"arm": "a"}]}
    (tmp_path / "old.json").write_text(json.dumps({"summary": {}}))
    with pytest.raises(SystemExit, match="before the benchmark harness"):
        harness.read_json(tmp_path / "old.json")
    with pytest.raises(SystemExit, match="does not exist"):
        harness.read_json(tmp_path / "missing.json")


def test_bar_panels_writes_a_png(tmp_path: Path):
    pytest.importorskip("matplotlib")
    s = harness.summarise(_records(), ["fp32", "bf16", "auto"], ["ms"], baseline="fp32")
    harness.bar_panels(tmp_path / "c.png", s, [Panel("ms", "step (ms)", "ms_ratio")], title="t")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class Toy(harness.Benchmark):
    """Pure: every run's reading is a function of its arm and repeat."""

    name = "toy"
    defaults = {"repeats": 3, "steps": 50}
    quick = {"repeats": 2, "steps": 5}

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def options(self, parser):
        parser.add_argument("--steps", type=int, default=None)

    def experiment(self, opts):
        return Experiment([Arm("base"), Arm("fast", {"speed": 2.0})], opts.repeats, baseline="base")

    def run(self, arm, repeat, opts):
        self.calls.append((arm.name, repeat, opts.steps))
        if arm.name == "fast" and repeat == 1:
            raise harness.Failed("exit code 1, RuntimeError: boom")
        return {"ms": (10.0 + repeat) / arm.params.get("speed", 1.0)}

    def summarise(self, data):
        return harness.summarise(data["records"], list(data["arms"]), ["ms"], data["baseline"])

    def report(self, data):
        s = data["summary"]
        return harness.markdown_table(
            ["arm", "ms", "ratio"], [[a, harness.fmt(s[a]["ms"]), harness.fmt(s[a].get("ms_ratio"), ".2f")] for a in s]
        )


def test_cli_quick_run_then_render(tmp_path: Path, capsys):
    bench = Toy()
    data = harness.main(bench, ["--quick", "--out", str(tmp_path)])
    assert bench.calls == [("base", 0, 5), ("fast", 0, 5), ("fast", 1, 5), ("base", 1, 5)]
    assert data["settings"]["repeats"] == 2 and data["settings"]["quick"] is True
    assert data["records"][2] == {
        "arm": "fast",
        "repeat": 1,
        "order": 2,
        "seconds": pytest.approx(0, abs=1),
        "error": "exit code 1, RuntimeError: boom",
    }
    written = json.loads((tmp_path / "toy.json").read_text())
    assert written["summary"]["fast"]["ms_ratio"]["runs"] == [0.5]
    md = (tmp_path / "toy.md").read_text()
    assert "| fast | 5.0 | 0.50 |" in md

    (tmp_path / "toy.md").unlink()
    bench2 = Toy()
    harness.main(bench2, ["--render", str(tmp_path / "toy.json")])
    assert bench2.calls == []  # nothing ran
    assert (tmp_path / "toy.md").read_text() == md
    assert "re-rendered toy.md" in capsys.readouterr().out


def test_cli_full_defaults_and_explicit_repeats(tmp_path: Path):
    bench = Toy()
    harness.main(bench, ["--repeats", "1", "--out", str(tmp_path), "--steps", "7"])
    assert bench.calls == [("base", 0, 7), ("fast", 0, 7)]


def test_rounding_keeps_checksums_and_takes_dicts_keyed_by_numbers():
    from benchmarks.harness.compact import dumps, rounded

    data = {"single": {1: 52.912345678912, 16: 157.7}, "checksum": 0.12345678901234567, "x": [1 / 3]}
    assert rounded(data) == {"single": {1: 52.9123457, 16: 157.7}, "checksum": 0.12345678901234567, "x": [0.333333333]}
    assert json.loads("{" + dumps(data).split("{", 1)[1])["single"] == {"1": 52.9123457, "16": 157.7}
