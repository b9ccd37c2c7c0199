"""What a callback may ask a strategy, named for what the callback needs to know, never for the strategy's class.

A callback reads :func:`capabilities_of` ``(trainer.strategy)``. The ds strategies declare theirs as the class
attribute ``capabilities`` (the shared base gives the defaults, each strategy overrides only where it differs); any
other Lightning strategy (``ddp``, ``fsdp``, a single device) gets :data:`LIGHTNING_DEFAULTS`, which describe how
Lightning's own strategies behave. So a callback never imports a strategy class to find out what it may do, and a new
strategy changes no callback: it states its capabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LIGHTNING_DEFAULTS", "StrategyCapabilities", "capabilities_of"]


@dataclass(frozen=True)
class StrategyCapabilities:
    """The facts about a strategy that callbacks act on; the defaults are those of Lightning's own strategies.

    Attributes:
        precision_plugin_wraps_forward: the model's forward runs inside the precision plugin's autocast context, so
            installing Lightning's AMP plugin (``MixedPrecision``) changes the precision it computes in.
            ``ds_pipeline``'s stages run inside torch's pipeline schedule instead, in 32-bit.
        agrees_over_default_group: every rank reaches each training step together, so a collective over the default
            process group at a step boundary (agreeing on a backup, gathering every rank's state) meets all ranks.
            ``ds_parameter_server``'s workers run at their own pace and take different numbers of steps.
        saves_from_chief_alone: the chief's checkpoint holds the whole run (the other ranks have nothing of their
            own to add, and do not call ``save_checkpoint``); otherwise every rank calls it, as Lightning requires.
        steps_optimizer_on_servers: the optimizer step, and the learning rate it applies, run in other processes
            (parameter servers), one worker's gradient per update: the Trainer's optimizers only hold settings.
        weights_rank_gradients: the strategy takes a training-loader factory and a per-rank gradient weight
            (``balance_batches(factory)`` and ``gradient_weight``), so ranks may train on batches of different sizes
            and still average the global batch's gradient.

    """

    precision_plugin_wraps_forward: bool = True
    agrees_over_default_group: bool = True
    saves_from_chief_alone: bool = False
    steps_optimizer_on_servers: bool = False
    weights_rank_gradients: bool = False


#: What a strategy that declares nothing gets: Lightning's own strategies behave this way.
LIGHTNING_DEFAULTS = StrategyCapabilities()


def capabilities_of(strategy: object) -> StrategyCapabilities:
    """The capabilities ``strategy`` declares (its ``capabilities`` attribute), or :data:`LIGHTNING_DEFAULTS`."""
    declared = getattr(strategy, "capabilities", None)
    return declared if isinstance(declared, StrategyCapabilities) else LIGHTNING_DEFAULTS
