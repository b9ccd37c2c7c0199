"""Option checks of ``ds_parameter_server``, run when the strategy is built (before any process starts)."""

from __future__ import annotations

from typing import Any, Literal

from ds_lightning.parameter_server.push_compression import PUSH_COMPRESSIONS

StalenessLR = Literal["none", "inverse"]


def _check_optional_int(name: str, value: object, minimum: int, fix: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: {fix}")


def check_options(
    num_servers: object,
    max_staleness: object,
    staleness_lr: object,
    push_every: object,
    compression: object,
    topk_ratio: object,
    max_updates: object,
    min_shard_bytes: object,
) -> None:
    """Refuse a bad option, naming the value and the fix.

    Raises:
        ValueError: for any option out of its range or not of its type.

    """
    _check_optional_int("num_servers", num_servers, 1, "start at least one server, e.g. num_servers=1.")
    _check_optional_int(
        "max_staleness",
        max_staleness,
        0,
        "use None (asynchronous), 0 (bulk synchronous) or k >= 1 (stale synchronous), e.g. max_staleness=4.",
    )
    if staleness_lr not in ("none", "inverse"):
        raise ValueError(f"staleness_lr={staleness_lr!r} is unknown; use 'none' or 'inverse'.")
    _check_optional_int("push_every", push_every, 1, "push at least every step, e.g. push_every=1.")
    if push_every is None:
        raise ValueError("push_every=None is invalid: pass an integer >= 1, e.g. push_every=1.")
    if compression not in PUSH_COMPRESSIONS:
        raise ValueError(f"compression={compression!r} is unknown; choose one of {list(PUSH_COMPRESSIONS)}.")
    if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float)) or not 0 < topk_ratio <= 1:
        raise ValueError(f"topk_ratio={topk_ratio!r} must be in (0, 1], e.g. topk_ratio=0.01.")
    _check_optional_int("max_updates", max_updates, 1, "use None or a positive number of server updates.")
    _check_optional_int("min_shard_bytes", min_shard_bytes, 1, "use a positive size, e.g. 262144.")


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
