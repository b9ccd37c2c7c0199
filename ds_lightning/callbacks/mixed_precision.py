"""``MixedPrecision``: bf16 or fp16 autocast with a configurable loss scaler, switched on by a callback."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.callbacks import _precision_probe as probe
from ds_lightning.callbacks._amp_plugin import SkipCountingAmpPlugin
from ds_lightning.callbacks._precision_probe import Chosen, PrecisionDecision
from ds_lightning.strategies.capabilities import capabilities_of

__all__ = ["MixedPrecision"]

PrecisionName = Literal["auto", "bf16", "fp16"]


class MixedPrecision(Callback):
    """Train with automatic mixed precision: the forward pass in bf16 or fp16, parameters and optimizer in fp32.

    ``precision="auto"`` measures instead of guessing. On the first training batch of ``fit`` every rank times a few
    forward and backward passes of the model's own ``training_step`` on that batch in fp32, bf16 and, on CUDA, fp16
    (with a loss scaler); the ranks agree on the slowest rank's figures (one all-reduce, under the strategy's
    timeout), and every rank trains in the same precision: fp32, unless another precision's median pass is faster
    by more than the noise of the repeats (at least 5%), then the fastest. Rank 0 logs the figures and the choice.
    The passes leave the parameters, gradients, buffers, optimizer state, random streams and data order as they
    were; ``self.log`` inside them is muted. The choice is checkpointed, and a resumed run reuses it without
    measuring again. See :mod:`ds_lightning.callbacks._precision_probe` for the rule.

    Under fp16 a ``torch.amp.GradScaler`` scales the loss; gradients are unscaled exactly once per optimizer step (also
    under gradient accumulation), before clipping and before ``on_before_optimizer_step``. A step whose gradients hold
    inf or NaN is skipped, so parameters never take them, and it is counted. The scaler's state is saved in
    checkpoints under the same key as ``Trainer(precision="16-mixed")``, so either resumes the other.

    Under the hood the callback installs Lightning's AMP precision plugin (when the run is set up, or under ``auto``
    once it has measured); do not also pass ``precision=`` to the Trainer. Under ``ds_parameter_server`` workers
    push unscaled gradients and an overflowing step pushes nothing. ``ds_pipeline`` runs in 32-bit and is refused.

    Logged on fp16: ``precision/loss_scale`` and ``precision/skipped_steps``.

    Args:
        precision: ``"auto"``, ``"bf16"`` or ``"fp16"``.
        init_scale: the fp16 loss scale to start from.
        growth_factor: multiply the scale by this after ``growth_interval`` steps without overflow (> 1).
        backoff_factor: multiply the scale by this after an overflow, in ``(0, 1)``.
        growth_interval: overflow-free steps before the scale grows.
        probe_passes: under ``auto``, timed forward and backward passes per precision (after one warm-up pass);
            the noise is read from their spread, so at least 3.

    Raises:
        ValueError: for an out-of-range option, naming the value and the fix.

    """

    #: Times the candidate precisions on this rank (the seam tests replace):
    #: ``(run_pass, candidates, passes, device) -> {candidate: [seconds per pass]}``.
    time_candidates: probe.TimeCandidates = staticmethod(probe.time_candidates)

    def __init__(
        self,
        precision: PrecisionName = "auto",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        probe_passes: int = 5,
    ) -> None:
        check.choice("precision", precision, ("auto", "bf16", "fp16"))
        check.number("init_scale", init_scale, "MixedPrecision(init_scale=65536.0)", above=0)
        check.number("growth_factor", growth_factor, "MixedPrecision(growth_factor=2.0)", above=1)
        check.number("backoff_factor", backoff_factor, "MixedPrecision(backoff_factor=0.5)", above=0, below=1)
        check.integer("growth_interval", growth_interval, 1, "MixedPrecision(growth_interval=2000)")
        check.integer("probe_passes", probe_passes, 3, "MixedPrecision(probe_passes=5)")
        self.precision = precision
        self.init_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.probe_passes = probe_passes
        self.chosen: Chosen | None = None  # once known: asked for, measured, or restored from a checkpoint
        self.decision: PrecisionDecision | None = None  # what auto measured (None when asked for)
        self.probe_seconds: float | None = None  # how long auto's measuring took on this rank
        self.plugin: SkipCountingAmpPlugin | None = None
        self._strategy: pl.strategies.Strategy | None = None
        self._measure_at_first_batch = False
        self._restored_skipped = 0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because their gradients overflowed."""
        return self.plugin.skipped_steps if self.plugin is not None else self._restored_skipped

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not capabilities_of(strategy).precision_plugin_wraps_forward:
            raise MisconfigurationException(
                "MixedPrecision cannot run under ds_pipeline, which runs its stages in 32-bit for now; remove the"
                " callback, or use ds_mirrored or ds_model_parallel for mixed precision."
            )
        current = strategy.precision_plugin
        if type(current) is not Precision and current is not self.plugin:  # ours stays after fit, for saving
            raise MisconfigurationException(
                f"MixedPrecision would replace the Trainer's {type(current).__name__} precision plugin; remove"
                " `precision=` from the Trainer and let the callback choose."
            )
        self._strategy = strategy
        if self.precision != "auto":
            self.chosen = self.precision
        self._measure_at_first_batch = self.chosen is None and stage == "fit"
        self._install(self.chosen or "fp32", strategy)
        self._restored_skipped = 0  # a resumed run's count arrives through load_state_dict, after setup

    def _install(self, chosen: Chosen, strategy: pl.strategies.Strategy) -> None:
        """Make ``strategy`` train in ``chosen``: Lightning's AMP plugin for bf16/fp16, its 32-bit plugin for fp32."""
        if chosen == "fp32":
            if self.plugin is not None and strategy.precision_plugin is self.plugin:
                strategy.precision_plugin = Precision()
            self.plugin = None
            return
        device = strategy.root_device
        scaler = None
        if chosen == "fp16":
            scaler = torch.amp.GradScaler(
                device.type,
                init_scale=self.init_scale,
                growth_factor=self.growth_factor,
                backoff_factor=self.backoff_factor,
                growth_interval=self.growth_interval,
            )
        self.plugin = SkipCountingAmpPlugin("16-mixed" if chosen == "fp16" else "bf16-mixed", device.type, scaler)
        strategy.precision_plugin = self.plugin

    # --- auto: measure at the first training batch ----------------------------------------------------------------

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._measure_at_first_batch:
            return
        self._measure_at_first_batch = False
        start = time.monotonic()
        self.decision = self._measure(trainer, pl_module, batch, batch_idx)
        self.probe_seconds = time.monotonic() - start
        self.chosen = self.decision.chosen
        self._install(self.chosen, trainer.strategy)
        rank_zero_info(
            f"MixedPrecision('auto') trains in {self.chosen}: {self.decision.reason}; measured in"
            f" {self.probe_seconds:.1f} s. Pass precision='bf16' or 'fp16' to choose without measuring."
        )

    def _measure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> PrecisionDecision:
        strategy = trainer.strategy
        device = strategy.root_device
        candidates = probe.candidates_for(device)
        if len(candidates) == 1:
            return PrecisionDecision("fp32", reason=f"it knows no low-precision path on a {device.type!r} device")
        if not pl_module.automatic_optimization:
            return PrecisionDecision(
                "fp32",
                reason="under manual optimization training_step steps the optimizer itself, so it cannot be"
                " timed without training",
            )
        params = list(pl_module.parameters())

        def run_pass(name: str) -> None:
            for param in params:
                param.grad = None  # as Lightning's zero_grad(set_to_none=True) before a step
            if name == "fp32":
                return one_pass(contextlib.nullcontext(), scaled=False)
            with probe.ruled_out_on_error(name):  # an op without a kernel for this dtype rules out the precision
                return one_pass(torch.autocast(device.type, dtype=probe.AUTOCAST_DTYPES[name]), scaled=name == "fp16")

        def one_pass(autocast: Any, scaled: bool) -> None:
            with autocast:
                out = self._training_step(strategy, pl_module, batch, batch_idx)
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                return  # a step that returns no loss: its forward alone is timed
            if scaled:
                scaler = torch.amp.GradScaler(device.type)  # a throwaway: the real one's state stays untouched
                scaler.scale(loss).backward()
                for optimizer in trainer.optimizers:
                    scaler.unscale_(optimizer)
            else:
                loss.backward()

        with probe.preserved(pl_module, [device]), probe.logging_muted(pl_module):
            seconds = self.time_candidates(run_pass, candidates, self.probe_passes, device)
        if not capabilities_of(strategy).agrees_over_default_group:
            # Parameter-server workers step on their own, so a collective here could wait on a rank (a server)
            # that never reaches it: each worker decides on its own figures, which is all its own steps need.
            return probe.decide({c: list(xs) for c, xs in seconds.items()})
        timeout = getattr(strategy, "_timeout", None)  # Lightning's DDP keeps the process group's timeout there
        agreed = probe.agree(
            seconds, candidates, device, timeout if isinstance(timeout, timedelta) else default_pg_timeout
        )
        return probe.decide(agreed)

    @staticmethod
    def _training_step(strategy: pl.strategies.Strategy, pl_module: pl.LightningModule, batch: Any, idx: int) -> Any:
        model = strategy.model
        # Past DDP's wrapper: its forward would arm the gradient all-reduce (and the comm hook's state) for the
        # backward, so the passes run on this rank alone. FSDP2's sharded root (the LightningModule itself, or a
        # wrapper) gathers the parameters in its own forward hooks, so the passes go through its __call__.
        if model is None or isinstance(model, DistributedDataParallel):
            return pl_module.training_step(batch, idx)
        if model is pl_module and not isinstance(model, FSDPModule):
            return pl_module.training_step(batch, idx)
        return strategy._forward_redirection(model, pl_module, "training_step", batch, idx)

    # --- logging and checkpoints ----------------------------------------------------------------------------------

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning's logger connector
        plugin = self.plugin
        if plugin is None or plugin.scaler is None or not every or trainer.global_step % every:
            return
        pl_module.log_dict(
            {
                "precision/loss_scale": float(plugin.scaler.get_scale()),
                "precision/skipped_steps": float(self.skipped_steps),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
            sync_dist=False,  # gradients are all-reduced before the scaler looks: the same on every rank
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "chosen": self.chosen,
            "decision": self.decision.as_dict() if self.decision is not None else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_skipped = int(state_dict.get("skipped_steps", 0))
        saved = state_dict.get("chosen")
        if self.precision == "auto" and saved in ("fp32", "bf16", "fp16"):
            # Called after setup and before Lightning restores the precision plugin's state (the fp16 scaler's), so
            # the plugin installed here receives it.
            self.chosen = saved
            self._measure_at_first_batch = False
            decision = state_dict.get("decision")
            self.decision = PrecisionDecision(**decision) if decision else None
            if self._strategy is not None:
                self._install(saved, self._strategy)
            rank_zero_info(f"MixedPrecision('auto') trains in {saved}, as the checkpoint it resumes from did.")
        if self.plugin is not None:
            self.plugin.skipped_steps = self._restored_skipped
