"""Controls for resume and parity tests: a checkpoint with a feature's state dropped, and how far two results are.

A resume test that compares a resumed run with a reference passes just as well when nothing was restored, if the
dropped state happens not to matter. Its control resumes the same file with that state removed (here: the
optimizer's per-parameter state, e.g. SGD momentum or Adam's moments) and asserts it ends farther from the result
than the comparison's tolerance, by a wide margin.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["assert_far", "distance", "without_optimizer_state"]


def without_optimizer_state(checkpoint: Path, out: Path) -> Path:
    """Write ``checkpoint`` to ``out`` with every optimizer's per-parameter state dropped; returns ``out``.

    The param groups (LR, momentum factor) and everything else in the file stay, so the model resumes at the saved
    step with the saved weights, but with fresh momentum buffers or Adam moments: what a resume that lost them does.
    """
    saved = torch.load(checkpoint, weights_only=False)
    assert any(optimizer["state"] for optimizer in saved["optimizer_states"]), f"{checkpoint} has no state to drop"
    for optimizer in saved["optimizer_states"]:
        optimizer["state"] = {}
    torch.save(saved, out)
    return out


def distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


def assert_far(
    result: Mapping[str, torch.Tensor], control: Mapping[str, torch.Tensor], bound: float, what: str
) -> float:
    """Assert the control ends more than ``bound`` from the result (pick a bound far above the test's tolerance)."""
    far = distance(result, control)
    assert far > bound, f"{what} ends only {far:.3g} from the result (bound {bound:g}): too close to tell apart"
    return far
