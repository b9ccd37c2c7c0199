"""MixedPrecision: options, how auto measures and decides (on 2 ranks too), its checkpointed choice, overflow
skipping, scaler state in checkpoints, refused combinations."""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset

from ds_lightning.callbacks import MixedPrecision
from ds_lightning.callbacks._precision_probe import MIN_MARGIN, agree, decide, ruled_out_on_error, time_candidates
from tests.helpers.models import OverflowingModule, TinyData, TinyModule
from tests.helpers.runner import run_ranks
from tests.helpers.trainers import quiet_trainer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp8"}, "precision='fp8'"),
        ({"init_scale": 0}, "init_scale=0"),
        ({"growth_factor": 1.0}, "growth_factor=1.0"),
        ({"backoff_factor": 1.0}, "backoff_factor=1.0"),
        ({"growth_interval": 0}, "growth_interval=0"),
        ({"probe_passes": 2}, "probe_passes=2"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MixedPrecision(**kwargs)


# --- the decision rule -----------------------------------------------------------------------------------------------


def _ms(*values: float) -> list[float]:
    return [v / 1000 for v in values]


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        # bf16's 20% lead is far above 5% and above the noise of either: bf16
        ({"fp32": _ms(10, 10.1, 9.9, 10, 10), "bf16": _ms(8, 8.1, 7.9, 8, 8)}, "bf16"),
        # a 3% lead on quiet figures is inside the 5% floor: fp32 stays
        ({"fp32": _ms(10, 10, 10, 10, 10), "bf16": _ms(9.7, 9.7, 9.7, 9.7, 9.7)}, "fp32"),
        # a 20% lead on figures whose interquartile ranges are 20% and 25% of their medians is noise: fp32 stays
        ({"fp32": _ms(8, 10, 10, 12, 14), "bf16": _ms(6, 8, 8, 10, 11)}, "fp32"),
        # slower is never picked
        ({"fp32": _ms(10, 10, 10, 10, 10), "bf16": _ms(30, 30, 30, 30, 30)}, "fp32"),
        # of two that clear the margin, the faster median wins
        ({"fp32": _ms(10, 10, 10, 10, 10), "bf16": _ms(7, 7, 7, 7, 7), "fp16": _ms(5, 5, 5, 5, 5)}, "fp16"),
        # one slow outlier moves neither the median nor the quartiles much: bf16's clear lead stands
        ({"fp32": _ms(10, 10, 10, 10, 10), "bf16": _ms(5, 5, 5, 5, 50)}, "bf16"),
    ],
)
def test_decide_keeps_fp32_within_the_noise_and_takes_a_clear_winner(seconds, expected):
    decision = decide(seconds)
    assert decision.chosen == expected, decision.reason
    assert decision.median_ms["fp32"] == pytest.approx(1000 * statistics.median(seconds["fp32"]))
    assert all(m >= MIN_MARGIN for m in decision.margin.values())
    assert ("fp32" in decision.reason) and (expected in decision.reason)


def test_decide_measures_the_margin_from_the_noisier_candidate():
    quiet = _ms(10, 10, 10, 10, 10)
    noisy = _ms(5, 6, 7, 9, 10)  # interquartile range 3 ms over a 7 ms median: 43%
    decision = decide({"fp32": quiet, "bf16": noisy})
    assert decision.noise["fp32"] == 0.0 and decision.noise["bf16"] == pytest.approx(3 / 7)
    assert decision.margin["bf16"] == pytest.approx(3 / 7)
    assert decision.chosen == "fp32"  # a 30% lead, inside its 43% margin
    steadier = decide({"fp32": quiet, "bf16": _ms(6.5, 6.8, 7, 7.2, 7.5)})  # the same median, 6% noise
    assert steadier.chosen == "bf16" and steadier.margin["bf16"] == pytest.approx(0.4 / 7)


def test_decide_refuses_figures_without_fp32():
    with pytest.raises(ValueError, match="fp32"):
        decide({"bf16": _ms(1, 1, 1)})


def test_candidates_are_timed_in_rotating_order_after_one_warm_up_round():
    order: list[str] = []
    seconds = time_candidates(order.append, ("fp32", "bf16"), 3, torch.device("cpu"))
    assert order == ["fp32", "bf16", "bf16", "fp32", "fp32", "bf16", "bf16", "fp32"]
    assert {c: len(v) for c, v in seconds.items()} == {"fp32": 3, "bf16": 3}  # the warm-up round left out


def test_a_precision_whose_pass_fails_is_not_run_again_and_cannot_win():
    order: list[str] = []

    def run_pass(name: str) -> None:
        order.append(name)
        with ruled_out_on_error(name):
            if name == "bf16":
                raise RuntimeError("no kernel for bfloat16")

    seconds = time_candidates(run_pass, ("fp32", "bf16"), 3, torch.device("cpu"))
    assert order == ["fp32", "bf16", "fp32", "fp32", "fp32"]
    assert seconds["bf16"] == [math.inf] * 3 and all(math.isfinite(x) for x in seconds["fp32"])
    decision = decide(seconds)
    assert decision.chosen == "fp32" and "bf16 could not run" in decision.reason


class _NoBf16(TinyModule):
    """A model with an op that has no bf16 kernel, as it would fail under bf16 autocast."""

    def training_step(self, batch, batch_idx):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("\"some_op\" not implemented for 'BFloat16'")
        return super().training_step(batch, batch_idx)


def test_auto_trains_in_fp32_when_the_model_cannot_run_in_bf16(tmp_path):
    amp = MixedPrecision("auto", probe_passes=3)
    quiet_trainer(tmp_path, [amp], max_steps=2).fit(_NoBf16(), TinyData())
    assert amp.chosen == "fp32" and amp.decision is not None and "bf16 could not run" in amp.decision.reason


def test_a_single_process_keeps_its_own_figures():
    figures = {"fp32": [0.01, 0.02], "bf16": [0.03, 0.04]}
    assert agree(figures, ["fp32", "bf16"], torch.device("cpu"), None) == figures


# --- auto in a training run --------------------------------------------------------------------------------------


def _timings(bf16_ms: float, calls: list[dict[str, Any]] | None = None, run: bool = False) -> Any:
    """A timing seam: fp32 takes 10 ms a pass, bf16 ``bf16_ms``; records its arguments; ``run`` runs the passes."""

    def timing(run_pass, candidates, passes, device):
        if calls is not None:
            calls.append({"candidates": tuple(candidates), "passes": passes, "device": device})
        if run:
            for name in candidates:
                run_pass(name)
        return {"fp32": _ms(*[10.0] * passes), "bf16": _ms(*[bf16_ms] * passes)}

    return timing


class _AutocastProbe(TinyModule):
    """TinyModule recording, per training step, its layer's output dtype and autocast's state (not the timing
    passes' calls: the step's own ``training_step`` is the last one before the batch ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, bool]] = []
        self.calls = 0
        self._last: tuple[torch.dtype, bool] | None = None

    def training_step(self, batch, batch_idx):
        self.calls += 1
        self._last = (self.layer(batch[0]).dtype, torch.is_autocast_enabled("cpu"))
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, *args: Any) -> None:
        assert self._last is not None
        self.seen.append(self._last)


@pytest.fixture
def rank_zero_lines():
    """Messages logged through Lightning's rank-zero logger (which does not propagate to pytest's caplog)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def test_auto_trains_every_step_in_what_it_measured_faster_and_logs_the_figures(tmp_path, rank_zero_lines):
    calls: list[dict[str, Any]] = []
    amp = MixedPrecision("auto")
    amp.time_candidates = _timings(5.0, calls, run=True)
    model = _AutocastProbe()
    logger = CSVLogger(tmp_path / "logs")
    trainer = quiet_trainer(tmp_path, [amp], max_steps=3, logger=logger, log_every_n_steps=1)
    trainer.fit(model, TinyData())
    assert calls == [{"candidates": ("fp32", "bf16"), "passes": 5, "device": torch.device("cpu")}]
    assert amp.chosen == "bf16" and trainer.precision_plugin is amp.plugin
    assert type(amp.plugin).__name__ == "SkipCountingAmpPlugin"
    assert model.seen == [(torch.bfloat16, True)] * 3  # the first step too
    assert model.calls == 3 + 2  # the seam ran one pass per candidate besides the steps
    rows = [r for r in csv.DictReader(Path(logger.log_dir, "metrics.csv").read_text().splitlines()) if r.get("loss")]
    assert len(rows) == 3  # training_step logs "loss": the timing passes logged nothing
    said = [line for line in rank_zero_lines if "MixedPrecision('auto')" in line]
    assert len(said) == 1 and "trains in bf16" in said[0] and "fp32 10.00 ms" in said[0] and "bf16 5.00 ms" in said[0]


def test_auto_on_this_cpu_really_measures_and_agrees_with_its_own_figures(tmp_path):
    amp = MixedPrecision("auto", probe_passes=3)
    model = _AutocastProbe()
    quiet_trainer(tmp_path, [amp], max_steps=2).fit(model, TinyData())
    assert amp.decision is not None and set(amp.decision.median_ms) == {"fp32", "bf16"}
    assert amp.chosen == amp.decision.chosen and amp.probe_seconds is not None
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[amp.chosen]
    assert model.seen == [(dtype, amp.chosen == "bf16")] * 2


def test_auto_that_keeps_fp32_leaves_the_trainer_alone_and_validate_does_not_measure_again(tmp_path):
    calls: list[dict[str, Any]] = []
    amp = MixedPrecision("auto")
    amp.time_candidates = _timings(9.9, calls)  # 1% faster: inside the margin
    model = _AutocastProbe()
    trainer = quiet_trainer(tmp_path, [amp], max_steps=2)
    trainer.fit(model, TinyData())
    trainer.validate(model, TinyData(), verbose=False)
    assert amp.chosen == "fp32" and amp.plugin is None and len(calls) == 1
    assert type(trainer.precision_plugin) is Precision  # the Trainer's own 32-bit plugin, untouched
    assert model.seen == [(torch.float32, False)] * 2


class _Noisy(pl.LightningModule):
    """Dropout (random), BatchNorm (running statistics) and SGD with momentum (optimizer state): whatever a timing
    pass could disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Dropout(0.5)
        )
        self.head = torch.nn.Linear(64, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.head(self.net(x)), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit_noisy(tmp_path: Path, callbacks: Callable[[_Noisy], list[Callback]]) -> _Noisy:
    """8 steps (2 epochs of a shuffled loader: the second epoch's order is drawn after the timing passes)."""
    pl.seed_everything(0, verbose=False)
    model = _Noisy()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 32, generator=g)
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16, shuffle=True)
    quiet_trainer(tmp_path, callbacks(model), max_steps=8).fit(model, loader)
    return model


def test_auto_keeping_fp32_ends_with_exactly_the_parameters_of_a_run_without_it(tmp_path):
    reference = _fit_noisy(tmp_path, lambda model: [])
    inside: dict[str, bool] = {}
    amps: list[MixedPrecision] = []

    def with_probe(model: _Noisy) -> list[Callback]:
        def timing(run_pass, candidates, passes, device):
            # The real passes, then figures that keep fp32; what the passes changed is read before it is put back.
            rng, stats = torch.get_rng_state(), model.net[1].running_mean.clone()
            time_candidates(run_pass, candidates, passes, device)
            inside["rng_moved"] = not torch.equal(rng, torch.get_rng_state())
            inside["stats_moved"] = not torch.equal(stats, model.net[1].running_mean)
            inside["grads"] = all(p.grad is not None for p in model.parameters())
            return {c: _ms(*[10.0] * passes) for c in candidates}

        amp = MixedPrecision("auto")
        amp.time_candidates = timing
        amps.append(amp)
        return [amp]

    probed = _fit_noisy(tmp_path, with_probe)
    assert [amp.chosen for amp in amps] == ["fp32"]
    # The control: the passes did move the random stream, the BatchNorm statistics and the gradients, so timing
    # passes that put nothing back would have changed this run.
    assert inside["rng_moved"] and inside["stats_moved"] and inside["grads"]
    for (name, got), want in zip(probed.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


# --- the choice in checkpoints -----------------------------------------------------------------------------------


def _resume(tmp_path: Path, path: Path | None, max_steps: int, model: pl.LightningModule) -> tuple[MixedPrecision, int]:
    """Fit under a fresh auto whose seam would keep fp32, from ``path`` (or from scratch); the seam's call count."""
    calls: list[dict[str, Any]] = []
    amp = MixedPrecision("auto", init_scale=8.0, growth_interval=1)
    amp.time_candidates = _timings(10.0, calls)
    quiet_trainer(tmp_path, [amp], max_steps=max_steps).fit(model, TinyData(), ckpt_path=path)
    return amp, len(calls)


def test_a_resumed_run_reuses_the_checkpointed_choice_without_measuring(tmp_path):
    amp = MixedPrecision("auto")
    amp.time_candidates = _timings(5.0)  # bf16 measured faster
    first = quiet_trainer(tmp_path, [amp], max_steps=2)
    first.fit(_AutocastProbe(), TinyData())
    path = tmp_path / "auto.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"]["MixedPrecision"]
    assert saved["chosen"] == "bf16" and saved["decision"]["median_ms"] == {"fp32": 10.0, "bf16": 5.0}
    resumed_model = _AutocastProbe()
    resumed, measured = _resume(tmp_path, path, 4, resumed_model)
    assert (resumed.chosen, measured) == ("bf16", 0)
    assert resumed.decision is not None and resumed.decision.median_ms == {"fp32": 10.0, "bf16": 5.0}
    assert resumed_model.seen == [(torch.bfloat16, True)] * 2  # steps 3 and 4, in bf16
    # The control: the same callback and seam without the checkpoint measure, and keep fp32.
    fresh, measured = _resume(tmp_path, None, 2, _AutocastProbe())
    assert (fresh.chosen, measured) == ("fp32", 1)


# --- two processes ---------------------------------------------------------------------------------------------


def test_two_ranks_agree_on_the_slowest_ranks_figures_even_when_one_rank_favours_another(tmp_path):
    out = str(tmp_path / "auto")
    run = run_ranks("tests.helpers.precision_runs", [out], 2, timeout=240)
    codes = [int(c) for c in re.findall(r"--- rank \d \(exit (-?\d+)\) ---", run.output)]
    assert codes == [0, 0], run.output[-4000:]
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(ranks):
        for name, fit in record.items():
            if not name.startswith("measured"):
                assert fit["calls"] == [
                    {"candidates": ["fp32", "bf16"], "passes": 5, "device": "cpu", "callable": True}
                ]
            assert fit["autocast"] == [fit["chosen"] == "bf16"] * 2, (rank, name)  # trained as decided
    for name in ranks[0]:
        assert ranks[0][name]["decision"] == ranks[1][name]["decision"], name  # identical figures, same choice
    chosen = {name: fit["chosen"] for name, fit in ranks[0].items()}
    # Alone, the rank that favours bf16 would take it (a 50% lead): the slower rank's figures keep fp32 on both.
    assert decide({"fp32": _ms(*[10] * 5), "bf16": _ms(*[5] * 5)}).chosen == "bf16"
    assert chosen["rank1_favours_bf16"] == chosen["rank0_favours_bf16"] == "fp32"
    assert chosen["both_favour_bf16"] == "bf16"
    assert ranks[0]["both_favour_bf16"]["decision"]["median_ms"]["bf16"] == pytest.approx(8.0)  # the slower rank's
    # The figures are logged once, by rank 0.
    rank0, rank1 = run.output.split("--- rank 1 ")
    assert rank0.count("MixedPrecision('auto') trains in") == 5 and "MixedPrecision('auto')" not in rank1


class _Snapshots(Callback):
    """Parameters before and after every optimizer step, and the loss scale at train start."""

    def __init__(self) -> None:
        self.before: list[dict[str, torch.Tensor]] = []
        self.after: list[dict[str, torch.Tensor]] = []
        self.scale_at_start: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scale_at_start = scaler.get_scale() if scaler is not None else None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.before.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})


def test_fp16_overflow_skips_that_step_counts_it_backs_off_and_keeps_parameters_finite(tmp_path):
    amp = MixedPrecision("fp16", init_scale=1024.0, growth_interval=1000)
    snapshots = _Snapshots()
    logger = CSVLogger(tmp_path / "logs")
    trainer = quiet_trainer(tmp_path, [amp, snapshots], max_steps=5, logger=logger, log_every_n_steps=1)
    trainer.fit(OverflowingModule(inf_at_step=2), TinyData(n=64, batch_size=8))
    assert amp.chosen == "fp16"
    assert amp.skipped_steps == 1
    assert trainer.precision_plugin is amp.plugin  # still installed, so a checkpoint saved after fit has the scaler
    for index, (before, after) in enumerate(zip(snapshots.before, snapshots.after, strict=True)):
        for name in before:
            assert torch.isfinite(after[name]).all(), (index, name)
            assert after[name].dtype == torch.float32
            moved = not torch.equal(before[name], after[name])
            assert moved == (index != 2), (index, name)  # only the overflowing step left parameters alone
    assert amp.state_dict()["skipped_steps"] == 1
    lines = Path(logger.log_dir, "metrics.csv").read_text().splitlines()
    rows = [r for r in csv.DictReader(lines) if r.get("precision/loss_scale")]
    # Logged after every step: the third step overflows, so from there the scale is halved and one step skipped.
    assert [float(r["precision/loss_scale"]) for r in rows] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert [float(r["precision/skipped_steps"]) for r in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("resume_as", ["fp16", "auto"])
def test_scaler_state_and_skip_count_round_trip_through_a_checkpoint(tmp_path, resume_as):
    """Resumed as auto, the fp16 choice is restored with its plugin before Lightning restores the scaler into it."""
    amp = MixedPrecision("fp16", init_scale=8.0, growth_interval=1)  # the scale doubles every clean step
    first = quiet_trainer(tmp_path, [amp], max_steps=4)
    first.fit(OverflowingModule(inf_at_step=1), TinyData(n=64, batch_size=8))
    path = tmp_path / "amp.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    saved_scale = float(checkpoint["MixedPrecision"]["scale"])
    assert saved_scale == 8.0 * 2 * 0.5 * 2 * 2  # grow, back off at step 1, grow, grow
    amp_again = MixedPrecision(resume_as, init_scale=8.0, growth_interval=1)
    calls: list[dict[str, Any]] = []
    amp_again.time_candidates = _timings(10.0, calls)  # would keep fp32, were it asked
    snapshots = _Snapshots()
    second = quiet_trainer(tmp_path, [amp_again, snapshots], max_steps=5)
    second.fit(OverflowingModule(inf_at_step=99), TinyData(n=64, batch_size=8), ckpt_path=path)
    assert snapshots.scale_at_start == saved_scale
    assert amp_again.skipped_steps == 1  # carried over from the first run
    assert (amp_again.chosen, calls) == ("fp16", [])


def test_a_trainer_precision_flag_is_refused_as_a_conflict(tmp_path):
    trainer = quiet_trainer(tmp_path, [MixedPrecision("bf16")], max_steps=1, precision="bf16-mixed")
    with pytest.raises(MisconfigurationException, match="remove `precision=` from the Trainer"):
        trainer.fit(TinyModule(), TinyData())


def test_ds_pipeline_refuses_mixed_precision_with_the_reason():
    # A real Trainer for two stages: building it starts no process; the refusal comes from the callback's setup.
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ds_pipeline", logger=False)
    with pytest.raises(MisconfigurationException, match="MixedPrecision cannot run under ds_pipeline"):
        MixedPrecision().setup(trainer, TinyModule(), "fit")
