"""``ds-train``: Lightning's CLI with the ds_lightning strategies registered first."""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
from typing import Any

import lightning
import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry

import ds_lightning

__all__ = ["DSLightningCLI", "main"]

# Before 2.5 the Trainer compares LightningCLI's internal `_class_path` hparam of the model and the datamodule like any
# other and stops with "Error while merging hparams" (Lightning issue 20182).
_CLASS_PATH_CLASHES = tuple(int(part) for part in lightning.__version__.split(".")[:2]) < (2, 5)


def _check_strategy_name(strategy: Any) -> None:
    if not isinstance(strategy, str) or strategy == "auto" or "." in strategy:
        return
    name = strategy.lower()
    if name in StrategyRegistry:
        return
    ours = ds_lightning.available_strategies()
    close = difflib.get_close_matches(name, StrategyRegistry.available_strategies(), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"Unknown strategy {strategy!r}.{hint} ds_lightning strategies: {', '.join(ours)}. Other registered names:"
        f" {', '.join(sorted(n for n in StrategyRegistry.available_strategies() if not n.startswith('ds_')))}."
    )


def _data_hparams_without_class_path(config_dump: dict[str, Any]) -> None:
    """Record the datamodule's hparams without ``_class_path`` when the model's carry one (Lightning < 2.5).

    LightningCLI's instantiator builds each module's hparams from ``config_dump``: a ``class_path`` there becomes the
    ``_class_path`` hparam. The datamodule still reloads with ``YourDataModule.load_from_checkpoint``.
    """
    model, data = config_dump.get("model"), config_dump.get("data")
    if isinstance(model, dict) and "class_path" in model and isinstance(data, dict) and "class_path" in data:
        config_dump["data"] = {**(data.get("init_args") or {}), **(data.get("dict_kwargs") or {})}


def _strategy_class_from_path(value: str) -> type[Strategy] | None:
    module_name, _, class_name = value.rpartition(".")
    if not module_name:
        return None
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, Strategy) else None


class DSLightningCLI(LightningCLI):
    """LightningCLI that resolves strategy class paths and validates names before any process starts."""

    def before_instantiate_classes(self) -> None:
        """Turn ``--trainer.strategy=pkg.Class`` into a class, and reject unknown names with the valid ones."""
        if _CLASS_PATH_CLASHES and isinstance(getattr(self, "config_dump", None), dict):
            _data_hparams_without_class_path(self.config_dump)
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.get("trainer")
        if trainer is None:
            return
        strategy = trainer.get("strategy")
        if isinstance(strategy, str) and "." in strategy:
            # jsonargparse matches the `str` branch of Trainer's `Union[str, Strategy]` first (Lightning issue 19682).
            cls = _strategy_class_from_path(strategy)
            if cls is None:
                raise ValueError(
                    f"--trainer.strategy={strategy!r} is neither a registered name nor an importable Strategy class;"
                    " use e.g. ds_lightning.strategies.MirroredStrategy or one of"
                    f" {ds_lightning.available_strategies()}."
                )
            trainer["strategy"] = Namespace(class_path=f"{cls.__module__}.{cls.__qualname__}", init_args=Namespace())
            return
        _check_strategy_name(strategy)

    def _parse_ckpt_path(self) -> None:
        # Lightning reads model hyperparameters from `--ckpt_path`; a checkpoint written outside LightningCLI has no
        # `_class_path`, which fails in subclass mode. Use the configured model class for it instead.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and Path(ckpt_path).is_file():
            hparams = torch.load(ckpt_path, weights_only=True, map_location="cpu").get("hyper_parameters", {})
            hparams.pop("_instantiator", None)
            class_path = getattr(self.config[subcommand].get("model"), "class_path", None)
            if hparams and "_class_path" not in hparams and class_path:
                update = {subcommand: {"model": {"class_path": class_path, "init_args": hparams}}}
                self.config = self.parser.parse_object(update, self.config)
                return
        super()._parse_ckpt_path()


def main(args: list[str] | None = None) -> None:
    """Entry point of ``ds-train``: ``ds-train fit --config examples/configs/mirrored.yaml``."""
    DSLightningCLI(
        model_class=None,
        datamodule_class=None,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
