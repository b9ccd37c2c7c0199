"""ds_pipeline's activation_checkpointing recomputes: each layer's forwards per step, counted in 2 real processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.strategies.test_pipeline import _fit, launch, load

STEPS, MICROBATCHES, ROWS = 3, 4, 32 // 4
# PipeMLP's 9 layers: 2 stages split [5, 4]; 4 stages split [3, 2, 2, 2] and placed in a loop or a V.
HELD = {
    "1F1B": [[0, 1, 2, 3, 4], [5, 6, 7, 8]],
    "Interleaved1F1B": [[0, 1, 2, 5, 6], [3, 4, 7, 8]],
    "ZBVZeroBubble": [[0, 1, 2, 7, 8], [3, 4, 5, 6]],
}
ZERO_BUBBLE_RECOMPUTES = pytest.mark.xfail(
    strict=True,
    reason="torch 2.13's zero-bubble schedules split each backward into an input pass and a weight pass, and the "
    "checkpointed forward is re-run 3 times per micro-batch on every stage with an input gradient (4 forwards, not 2)",
)


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checkpointing")
    runs = [
        _fit(
            root / f"{name}-{flag}.pt",
            {"schedule": name, "n_microbatches": MICROBATCHES, "activation_checkpointing": flag},
            STEPS,
            probe=str(root / f"{name}-{flag}"),
        )
        for name in HELD
        for flag in (False, True)
    ]
    launch(root, "checkpointing", 2, runs)
    return root


def forwards_per_step(root: Path, run: str, rank: int) -> dict[tuple[int, int], list[Any]]:
    """``{(step, layer): [(rows, grad enabled), ...]}`` of one rank's layers in the training steps."""
    record = json.loads((root / f"{run}.rank{rank}.json").read_text())
    calls: dict[tuple[int, int], list[Any]] = {}
    for phase, step, layer, rows, device, grad in record["calls"]:
        assert phase == "train" and device == "cpu", (phase, device)
        calls.setdefault((step, layer), []).append((rows, grad))
    return calls


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "schedule", ["1F1B", "Interleaved1F1B", pytest.param("ZBVZeroBubble", marks=ZERO_BUBBLE_RECOMPUTES)]
)
def test_checkpointing_reruns_each_layers_forward_once_per_microbatch(probes, schedule):
    for rank in (0, 1):
        plain = forwards_per_step(probes, f"{schedule}-False", rank)
        checkpointed = forwards_per_step(probes, f"{schedule}-True", rank)
        # Every layer this rank holds ran, in every step, and no other layer did.
        layers_run = {layer for _, layer in plain}
        assert layers_run == {layer for _, layer in checkpointed} == set(HELD[schedule][rank]), f"rank {rank}"
        assert {step for step, _ in plain} == {step for step, _ in checkpointed} == set(range(STEPS))
        # The first step also runs one forward of torch's own to infer the stage's shapes; the later steps are exact.
        for step in range(1, STEPS):
            for layer in HELD[schedule][rank]:
                where = f"{schedule} rank {rank} step {step} layer {layer}"
                # Without checkpointing: one forward per micro-batch, its activations kept for the backward pass.
                assert plain[step, layer] == [(ROWS, True)] * MICROBATCHES, where
                # With it: the same forwards, then each again in the backward pass to rebuild the activations.
                assert checkpointed[step, layer] == [(ROWS, True)] * 2 * MICROBATCHES, where


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", list(HELD))
def test_checkpointing_keeps_every_loss_and_weight(probes, schedule):
    plain, checkpointed = load(probes / f"{schedule}-False.pt"), load(probes / f"{schedule}-True.pt")
    assert len(plain["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(checkpointed["losses"]), torch.tensor(plain["losses"]))
    for name, value in plain["final"].items():
        torch.testing.assert_close(checkpointed["final"][name], value, msg=lambda m, n=name: f"{n}: {m}")
