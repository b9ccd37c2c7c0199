"""``ds-train``: Lightning's CLI with the ds_lightning strategies registered first."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning
import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info

import ds_lightning
from ds_lightning.demos.quickstart import SHORT_NAMES, demo_config

__all__ = ["DSLightningCLI", "main", "seed_spelling"]

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


def _strategy_name(value: str) -> str:
    """``--strategy``'s value as ``--trainer.strategy`` takes it.

    A short name (``mirrored``) becomes its registered ``ds_`` name; a registered name or a class path stays as it is.
    """
    if "." in value:
        return value  # a class path: DSLightningCLI imports and checks it
    name = value.lower()
    if name in SHORT_NAMES:
        return SHORT_NAMES[name]
    if name in StrategyRegistry:
        return name
    close = difflib.get_close_matches(name, [*SHORT_NAMES, *StrategyRegistry.available_strategies()], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"--strategy={value!r} names no strategy.{hint} Choices: {', '.join(SHORT_NAMES)}; also a registered name"
        f" ({', '.join(ds_lightning.available_strategies())}, or Lightning's, e.g. ddp) or a Strategy class path."
    )


def _pop_strategy(args: list[str]) -> tuple[str | None, list[str]]:
    """``--strategy NAME`` / ``--strategy=NAME`` taken out of ``args`` (the last one wins, as for any option)."""
    strategy, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--strategy":
            if i + 1 == len(args):
                raise ValueError(f"--strategy needs a name, one of {', '.join(SHORT_NAMES)}.")
            strategy, i = args[i + 1], i + 2
            continue
        if arg.startswith("--strategy="):
            strategy = arg.partition("=")[2]
        else:
            rest.append(arg)
        i += 1
    return strategy, rest


_SOURCES = ("--model", "--data", "--config", "-c")


def _names_a_source(arg: str) -> bool:
    # `--model.lr=0.1` only tunes a model: without `--model CLASS` it tunes the demo's.
    return arg in _SOURCES or arg.startswith(tuple(f"{flag}=" for flag in _SOURCES))


def _chosen_strategy(args: Sequence[str]) -> str:
    values = [a.partition("=")[2] for a in args if a.startswith("--trainer.strategy=")]
    values += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--trainer.strategy"]
    return values[-1] if values else SHORT_NAMES["mirrored"]


def seed_spelling(args: Sequence[str]) -> list[str]:
    """The seed's command line (``train --strategy=mirrored``) in LightningCLI's terms.

    ``train`` is ``fit``. ``--strategy=NAME`` (before or after the subcommand) becomes ``--trainer.strategy=ds_NAME``
    for the short names, placed last so that it wins over a config's strategy. ``fit`` with no ``--model``,
    ``--data`` or ``--config`` trains the bundled digits demo (:func:`~ds_lightning.demos.quickstart.demo_config`),
    which options given after it (``--trainer.max_epochs=1``) still change.

    Raises:
        ValueError: ``--strategy`` names no strategy (the message lists the choices); ``ds-train`` prints it and
            exits with status 2.

    """
    strategy, rest = _pop_strategy(list(args))
    if rest and rest[0] == "train":
        rest[0] = "fit"
    if strategy is not None:
        rest.append(f"--trainer.strategy={_strategy_name(strategy)}")
    asks_help = any(a in ("-h", "--help") for a in rest)
    if rest and rest[0] == "fit" and not asks_help and not any(_names_a_source(a) for a in rest[1:]):
        chosen = _chosen_strategy(rest)
        rest[1:1] = ["--config", demo_config(chosen)]
        rank_zero_info(
            f"ds-train: no --model, --data or --config, so training the bundled demo (the digits classifier) under"
            f" {chosen}; ds-train fit --config FILE trains your own."
        )
    return rest


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
    """Entry point of ``ds-train``: ``ds-train fit --config examples/configs/mirrored.yaml``.

    The seed's spelling works too: ``ds-train train --strategy=mirrored`` (:func:`seed_spelling`), and
    ``ds-train diagnose DIR`` reads a stuck run's Flight Recorder dumps again (:mod:`ds_lightning.diagnostics.analyze`).
    """
    given = sys.argv[1:] if args is None else args
    if given[:1] == ["diagnose"]:
        if len(given) != 2:
            print("ds-train: error: usage: ds-train diagnose DIR (a run's flight_recorder folder)", file=sys.stderr)
            raise SystemExit(2)
        from ds_lightning.diagnostics.analyze import main as diagnose

        raise SystemExit(diagnose(given[1]))
    try:
        spelled = seed_spelling(sys.argv[1:] if args is None else args)
    except ValueError as err:  # from the spelling alone: nothing else runs in this try
        print(f"ds-train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args is None:
        # From the command line, the spelled-out arguments become the command line: Lightning's launcher starts the
        # other ranks with sys.argv (which spell out to themselves), and LightningCLI warns when given both.
        sys.argv[1:] = spelled
    DSLightningCLI(
        model_class=None,
        datamodule_class=None,
        args=None if args is None else spelled,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
