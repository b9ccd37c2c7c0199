"""Option checks of ``ds_parameter_server``, run when the strategy is built (before any process starts)."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from ds_lightning import _validation as check
from ds_lightning.comm.compression import get
from ds_lightning.comm.compression.none import NO_COMPRESSION

StalenessLR = Literal["none", "inverse"]


def check_options(
    num_servers: object,
    max_staleness: object,
    staleness_lr: object,
    push_every: object,
    gradient_compression: object,
    topk_ratio: object,
    max_updates: object,
    min_shard_bytes: object,
) -> None:
    """Refuse a bad option, naming the value and the fix.

    Raises:
        ValueError: for any option out of its range or not of its type.

    """
    example = "ParameterServerStrategy"
    check.optional_integer(
        "num_servers", num_servers, 1, f"{example}(num_servers=2)", "None means 1, or one per TF_CONFIG ps task"
    )
    check.optional_integer(
        "max_staleness", max_staleness, 0, f"{example}(max_staleness=4)", "None: asynchronous; 0: bulk synchronous"
    )
    check.choice("staleness_lr", staleness_lr, ("none", "inverse"))
    check.integer("push_every", push_every, 1, f"{example}(push_every=1)")
    get(gradient_compression, use="push")
    check.number("topk_ratio", topk_ratio, f"{example}(topk_ratio=0.01)", above=0, at_most=1)
    check.optional_integer("max_updates", max_updates, 1, f"{example}(max_updates=1000)", "None: no budget")
    check.integer("min_shard_bytes", min_shard_bytes, 1, f"{example}(min_shard_bytes=262144)")


def gradient_compression_option(gradient_compression: str, compression: str | None) -> str:
    """The push compression from the option and its deprecated name ``compression``, with a warning for the latter.

    Raises:
        ValueError: when both are set to different values.

    """
    if compression is None:
        return gradient_compression
    warnings.warn(
        f"ds_parameter_server's compression={compression!r} is deprecated: write"
        f" gradient_compression={compression!r}, the option ds_mirrored takes too.",
        DeprecationWarning,
        stacklevel=3,
    )
    if gradient_compression not in (compression, NO_COMPRESSION):
        raise ValueError(
            f"compression={compression!r} and gradient_compression={gradient_compression!r} both set the push"
            " compression: keep only gradient_compression."
        )
    return compression


def check_no_validation_under_budget(max_updates: int | None, trainer: Any) -> None:
    """Refuse validation during ``fit`` under an update budget, which ends the workers' fits at different epochs.

    Raises:
        ValueError: when ``max_updates`` is set and ``fit`` has validation batches.

    """
    if (
        max_updates is not None
        and trainer.limit_val_batches != 0
        and trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined()
    ):
        raise ValueError(
            f"ds_parameter_server(max_updates={max_updates}) stops workers at different epochs, so validation"
            " during fit would pair up different epochs across workers. Set Trainer(limit_val_batches=0) and"
            " run trainer.validate(...) after fit, or bound the run with max_epochs/max_steps instead."
        )
