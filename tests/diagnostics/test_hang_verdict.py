"""The verdict from every rank's view (no processes: the views are what ranks post through the store)."""

from __future__ import annotations

from ds_lightning.diagnostics import Call, RankView, judge
from ds_lightning.diagnostics.hang_verdict import place_of


def call(seq: int, op: str = "all_reduce", sizes: list | None = None, place: str = "backward (x.py:1)") -> Call:
    return Call("0", "default_pg", seq, op, sizes or [[8]], place)


STUCK = call(7)


def test_every_rank_waiting_in_the_same_call_means_the_link_is_too_slow() -> None:
    views = {r: RankView(r, "h", [call(7)], {"0": 7}) for r in range(3)}
    verdict = judge(STUCK, 10, range(3), views)
    assert (verdict.kind, verdict.arrived) == ("slow", [0, 1, 2])
    assert "too slow for the timeout" in verdict.message()


def test_a_rank_behind_did_not_arrive_and_a_silent_one_is_named_apart() -> None:
    views = {0: RankView(0, "h", [call(7)], {"0": 7}), 1: RankView(1, "h", [], {"0": 6}, "training_step (m.py:3)")}
    verdict = judge(STUCK, 10, [0, 1, 2], {**views, 2: None})
    assert verdict.kind == "missing"
    assert verdict.missing == {1: "training_step (m.py:3)"} and verdict.silent == [2] and verdict.arrived == [0]
    assert "rank 1 is in training_step (m.py:3)" in verdict.message()
    assert "Did not answer: rank 2 (the process is gone" in verdict.message()


def test_another_op_or_other_sizes_at_the_same_sequence_number_is_a_desync() -> None:
    views = {
        0: RankView(0, "h", [call(7)], {"0": 7}),
        1: RankView(1, "h", [call(7, op="broadcast")], {"0": 7}),
        2: RankView(2, "h", [call(7, sizes=[[9]])], {"0": 7}),
    }
    verdict = judge(STUCK, 10, range(3), views)
    assert verdict.kind == "desync" and sorted(verdict.desync) == [1, 2] and verdict.arrived == [0]
    assert "rank 1 waits in broadcast #7" in verdict.message()


def test_calls_on_another_group_do_not_count() -> None:
    other_group = Call("1", "dp", 7, "all_reduce", [[8]], "x")
    verdict = judge(
        STUCK, 10, [0, 1], {0: RankView(0, "h", [call(7)], {"0": 7}), 1: RankView(1, "h", [other_group], {"0": 5})}
    )
    assert verdict.missing == {1: "unknown"}


def test_the_place_is_the_innermost_lightning_hook_outside_torch() -> None:
    frames = [
        {"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 1},
        {"name": "backward", "filename": "/x/torch/_tensor.py", "line": 2},
        {"name": "backward", "filename": "/x/lightning/pytorch/core/module.py", "line": 3},
        {"name": "training_step", "filename": "/u/model.py", "line": 4},
    ]
    assert place_of(frames) == "backward (core/module.py:3)"
    assert place_of([{"name": "start", "filename": "/p/ds_lightning/backup/agreement.py", "line": 9}]).startswith(
        "BackupAndRestore's step agreement"
    )
    assert place_of([]) == "unknown"
