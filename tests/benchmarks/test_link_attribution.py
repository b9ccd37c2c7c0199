"""The link-attribution benchmark's reading, summary, verdict, page and kept files, on synthetic reports (nothing is
launched, no cluster is built)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness
from benchmarks.link_attribution import launch, page
from benchmarks.link_attribution.driver import LinkAttribution, median_launch, reading
from ds_lightning.pipeline.trace import Span, write_chrome_trace

HOSTS = ["198.18.7.1", "198.18.7.2", "198.18.7.3"]
RESULT = {"exit_codes": [0, 0, 0], "timed_out": False, "launch_s": 21.0, "logs": ["", "", ""]}
SETTINGS = {"repeats": 3, "steps": 40, "fast_mbit": 200.0, "slow_mbit": 20.0, "hidden": [256, 256]}


def _document(step: float, link_ms: list[float], rates: list[float | None], slow: str | None) -> dict[str, Any]:
    """A report.json as rank 0 writes it; its hosts and ranks deliberately out of order."""
    hosts = [
        {"host": HOSTS[i], "ranks": [i], "rate_mb_s": rates[i], "link_ms": link_ms[i], "sent": 9, "received": 9}
        for i in (1, 2, 0)
    ]
    ranks = [
        {"rank": r, "step_ms": step + r - 1, "wire_sent": 18_000_000 + r, "wire_received": 17e6} for r in (2, 0, 1)
    ]
    return {
        "verdict": {"straggler": None, "bound": "link-bound", "reason": "the links set the pace"},
        "links": {"hosts": hosts, "slow_host": slow, "reason": f"named {slow}"},
        "ranks": ranks,
        "table": f"DistributedReport table, step {step}",
    }


def _record(arm: str, repeat: int, step: float, h2: float, slow: str | None = None, rate2: float = 2.5) -> dict:
    other = 3.0 if arm == "slowed" else 0.0
    document = _document(step, [h2 - other, h2 - 2 * other, h2], [120.0, 80.0, rate2], slow)
    order = 2 * repeat + (arm == "slowed")
    return {"arm": arm, "repeat": repeat, "order": order, "seconds": 22.0, **reading(document, HOSTS, RESULT)}


def _records(named: tuple[str | None, ...] = (HOSTS[2],) * 3, control: str | None = None) -> list[dict]:
    out = []
    for rep, (equal, slowed, h2e, h2s) in enumerate([(20.0, 190.0, 18.0, 186.0), (22.0, 200.0, 20.0, 196.0),
                                                     (21.0, 185.0, 19.0, 170.0)]):  # fmt: skip
        out += [_record("equal", rep, equal, h2e, control, 30.0), _record("slowed", rep, slowed, h2s, named[rep])]
    return out


def _data(records: list[dict]) -> dict[str, Any]:
    setup = {"hosts": HOSTS, "links": {"equal": {"qdisc": {"0": "tbf"}}}, "files": {}}
    arms = {"equal": "every link fast", "slowed": "host 2 slow"}
    return {"benchmark": "link_attribution", "settings": SETTINGS, "workload": "MLP", "arms": arms, "setup": setup,
            "records": records}  # fmt: skip


def test_reading_puts_hosts_in_cluster_order_and_takes_the_median_rank_step():
    r = _record("slowed", 0, 190.0, 186.0, HOSTS[2])
    assert r["step_ms"] == 190.0 and r["rank_step_ms"] == [189.0, 190.0, 191.0]
    assert r["link_ms"] == [183.0, 180.0, 186.0] and r["host2_link_ms"] == 186.0
    assert r["rate_mb_s"] == [120.0, 80.0, 2.5] and r["other_rate_mb_s"] == 80.0  # the slower of the other two
    assert (r["slow_host"], r["named_index"], r["named_slow"]) == (HOSTS[2], 2, True)
    assert r["wire_sent"] == [18_000_000, 18_000_001, 18_000_002] and r["exit_codes"] == [0, 0, 0]
    assert r["table"] == "DistributedReport table, step 190.0" and r["bound"] == "link-bound"
    wrong = _record("slowed", 0, 190.0, 186.0, HOSTS[0])
    assert (wrong["named_index"], wrong["named_slow"]) == (0, False)
    no_rate = reading(_document(30.0, [1.0, 1.0, 1.0], [None, 80.0, 30.0], None), HOSTS, RESULT)
    assert no_rate["other_rate_mb_s"] is None and no_rate["named_index"] is None and not no_rate["named_slow"]


def test_a_launch_fails_on_any_ranks_exit_code_a_timeout_or_a_missing_report():
    logs = ["", "", "Traceback\nRuntimeError: Connection reset by peer\n"]
    assert launch.failure(RESULT, report_found=True) is None
    why = launch.failure({**RESULT, "exit_codes": [0, 0, 1], "logs": logs}, report_found=True)
    assert why is not None and "exit codes [0, 0, 1]" in why and "rank 2: RuntimeError: Connection reset" in why
    late = launch.failure({**RESULT, "exit_codes": [-9, -9, -9], "timed_out": True, "launch_s": 240.2}, True)
    assert late is not None and late.startswith("timed out after 240 s")
    assert "no report.json" in str(launch.failure(RESULT, report_found=False))


def test_the_summary_pairs_repeats_and_judges_the_share(tmp_path: Path):
    data = _data(_records())
    s = LinkAttribution().summarise(data)
    assert s["added_step_ms"]["runs"] == [170.0, 178.0, 164.0]
    assert s["attributed_ms"]["runs"] == [168.0, 176.0, 151.0]
    assert s["share"]["runs"] == pytest.approx([168 / 170, 176 / 178, 151 / 164])
    assert s["equal"]["step_ms"]["median"] == 21.0 and s["slowed"]["step_ms"]["median"] == 190.0
    assert s["slow_rate_mb_s"]["median"] == 2.5 and s["other_rate_mb_s"]["median"] == 80.0
    assert (s["named"], s["control_named"]) == ("3 of 3", "0 of 3")
    # The slowed launch at the median step (190 ms, repeat 0) and its repeat's equal launch.
    assert s["median_repeat"] == 0 and s["slowed_table"].endswith("190.0") and s["equal_table"].endswith("20.0")
    (v,) = s["verdicts"]
    assert (v["target"], v["verdict"], v["launches"]) == (">= 0.80", "met", 3)
    assert v["median"] == pytest.approx(168 / 170)

    harness.write_json(tmp_path / "link_attribution.json", data)
    harness.main(LinkAttribution(), ["--render", str(tmp_path / "link_attribution.json")])
    text = (tmp_path / "link_attribution.md").read_text()
    assert "| 1 | slowed | 190.0 | 183 / 180 / 186 | 120.0 / 80.0 / 2.5 | host 2 (198.18.7.3) |" in text
    assert "| share: attributed / added (target >= 0.80) | 0.99 [0.92 - 0.99] |" in text
    assert "```text\nDistributedReport table, step 190.0\n```" in text and "step 20.0\n```" in text
    assert "| >= 0.80 | 0.988 [0.921 - 0.989] | 3 | met |" in text


def test_a_failed_launch_is_counted_shown_and_leaves_too_few_to_judge(tmp_path: Path):
    records = _records()
    records[3] = {"arm": "slowed", "repeat": 1, "order": 3, "seconds": 240.0, "error": "exit codes [0, 1, 0]"}
    data = _data(records)
    s = LinkAttribution().summarise(data)
    assert s["named"] == "2 of 2 (1 failed)" and s["slowed"]["failed_runs"] == 1
    assert len(s["share"]["runs"]) == 2 and s["verdicts"][0]["verdict"] == "not judged"
    assert s["median_repeat"] == 2  # of 185 and 190 ms, the lower middle
    harness.write_json(tmp_path / "link_attribution.json", data)
    harness.main(LinkAttribution(), ["--render", str(tmp_path / "link_attribution.json")])
    text = (tmp_path / "link_attribution.md").read_text()
    assert "| 2 | slowed | FAILED: exit codes [0, 1, 0] |" in text and "1 launch(es) failed" in text


@pytest.mark.parametrize(
    ("named", "control", "counts"),
    [
        ((HOSTS[2], HOSTS[0], HOSTS[2]), None, ("2 of 3", "0 of 3")),  # one slowed launch blamed host 0
        ((HOSTS[2], None, HOSTS[2]), None, ("2 of 3", "0 of 3")),  # one named no host
        ((HOSTS[2],) * 3, HOSTS[1], ("3 of 3", "3 of 3")),  # the controls named a host
    ],
)
def test_a_share_met_without_naming_host_2_alone_is_missed(named, control, counts):
    s = LinkAttribution().summarise(_data(_records(named, control)))
    assert (s["named"], s["control_named"]) == counts
    assert s["share"]["median"] >= 0.8 and s["verdicts"][0]["verdict"] == "missed"


def test_the_median_launchs_files_are_kept_small_and_its_trace_drawn(tmp_path: Path):
    from PIL import Image

    records = _records()
    chosen, equal = median_launch(records)
    assert chosen is not None and equal is not None and (chosen["repeat"], equal["repeat"]) == (0, 0)
    kept = {}
    for r in records:
        folder = tmp_path / f"{r['arm']}{r['repeat']}"
        folder.mkdir()
        Image.new("RGBA", (40, 20), (r["repeat"] * 100, 0, 0, 255)).save(folder / "report.png")
        kept[(r["arm"], r["repeat"])] = folder
    steps = range(2, 40)
    spans = [Span(rank, 0, "comm", 0, step, 1000 * step, 1000 * step + 900) for rank in range(3) for step in steps]
    write_chrome_trace(spans, tmp_path / "slowed0" / "trace.json")
    out = tmp_path / "out"
    out.mkdir()
    (out / "link_attribution_trace_slowed.png").write_bytes(b"an older run's")
    files = page.keep_files(chosen, kept, out, "link_attribution", trace_steps=6)
    assert files == {"repeat": 0, "report_png": "link_attribution_report.png",
                     "trace_json": "link_attribution_trace_slowed.json", "trace_steps": [18, 23]}  # fmt: skip
    with Image.open(out / "link_attribution_report.png") as image:  # a palette PNG, as every committed chart
        assert image.mode == "P" and image.convert("RGB").getpixel((0, 0)) == (0, 0, 0)
    assert not (out / "link_attribution_trace_slowed.png").exists()  # gone until drawn from the new trace
    data = {**_data(records), "setup": {"files": files}}
    (png,) = page.trace_png(data, out, "link_attribution")
    assert png == out / "link_attribution_trace_slowed.png" and png.read_bytes()[:4] == b"\x89PNG"
    # No successful slowed launch: nothing kept, and an older run's files removed.
    assert page.keep_files(None, kept, out, "link_attribution", trace_steps=6) == {}
    assert not (out / "link_attribution_report.png").exists() and page.trace_png(data, out, "link_attribution") == []
