"""Every private Lightning name ds_lightning relies on still exists in the installed Lightning.

The list is docs/lightning-private-api.md's: a Lightning upgrade that renames or removes one fails here, by name,
instead of deep inside a distributed run. ``make test-versions`` runs this file on the lowest and highest Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

import lightning
import pytest
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy

LIGHTNING = tuple(int(part) for part in lightning.__version__.split(".")[:2])

# (module, attribute path, first Lightning (major, minor) that has it): imported names and the members used.
IMPORTED: list[tuple[str, str, tuple[int, int]]] = [
    ("lightning.fabric.strategies.registry", "_StrategyRegistry", (2, 4)),
    ("lightning.fabric.utilities.types", "_PATH", (2, 4)),
    ("lightning.fabric.utilities.distributed", "_init_dist_connection", (2, 4)),
    ("lightning.fabric.utilities.distributed", "_destroy_dist_connection", (2, 4)),
    ("lightning.fabric.utilities.distributed", "_sync_ddp_if_available", (2, 4)),
    ("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed", (2, 4)),
    ("lightning.fabric.utilities.optimizer", "_optimizers_to_device", (2, 4)),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_basic_subprocess_cmd", (2, 4)),
    ("lightning.pytorch.strategies.launchers.launcher", "_Launcher", (2, 4)),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher", (2, 4)),
    (
        "lightning.pytorch.strategies.launchers.subprocess_script",
        "_SubprocessScriptLauncher._call_children_scripts",
        (2, 4),
    ),
    ("lightning.pytorch.core.optimizer", "_configure_optimizers", (2, 4)),
    ("lightning.pytorch.core.optimizer", "_configure_schedulers_automatic_opt", (2, 4)),
    ("lightning.pytorch.strategies", "DDPStrategy._get_process_group_backend", (2, 4)),
    # Methods that ds strategies override: a rename would leave the override silently unused.
    ("lightning.pytorch.strategies", "DDPStrategy._configure_launcher", (2, 4)),
    ("lightning.pytorch.strategies", "DDPStrategy._setup_model", (2, 4)),
    ("lightning.pytorch.strategies", "DDPStrategy._register_ddp_hooks", (2, 4)),
    # BackupAndRestore preloads its backup and builds a checkpoint dict without Trainer.save_checkpoint's barrier.
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector",
        "_CheckpointConnector.resume_start",
        (2, 4),
    ),
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector",
        "_CheckpointConnector.dump_checkpoint",
        (2, 4),
    ),
    # Overridden by DSLightningCLI; Lightning 2.4 has no such step (it reads no hparams from --ckpt_path).
    ("lightning.pytorch.cli", "LightningCLI._parse_ckpt_path", (2, 5)),
    # The step clock times the broadcast before each batch as communication; Lightning 2.4 and 2.5 do not broadcast.
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor", (2, 6)),
]

# Instance attributes read or set on Lightning objects (they exist only once the object is built).
STRATEGY_ATTRIBUTES = [
    "_timeout",
    "_num_nodes",
    "_process_group_backend",
    "_launcher",
    "_precision_plugin",
    "_forward_redirection",  # ds_mirrored's fsdp2 engine routes steps through the sharded root's __call__
]


def _resolve(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("module", "path", "since"), IMPORTED, ids=[f"{m}.{p}" for m, p, _ in IMPORTED])
def test_private_name_exists(module, path, since):
    if since > LIGHTNING:
        pytest.skip(f"not used before Lightning {since[0]}.{since[1]}; installed {lightning.__version__}")
    try:
        _resolve(module, path)
    except (ImportError, AttributeError) as err:
        pytest.fail(
            f"{module}.{path} is gone in Lightning {lightning.__version__} ({err}); ds_lightning uses it: see"
            " docs/lightning-private-api.md for where and why"
        )


def test_the_epoch_loops_sigterm_broadcast_exists_from_2_5():
    # ds_parameter_server replaces this per-step collective with a local check; before 2.5 there is none to replace.
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    has_it = hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor")
    assert has_it == (LIGHTNING >= (2, 5)), f"Lightning {lightning.__version__}: _broadcast_sigterm_tensor={has_it}"


@pytest.mark.parametrize("name", STRATEGY_ATTRIBUTES)
def test_ddp_strategy_attribute_exists(name):
    assert hasattr(DDPStrategy(), name), f"DDPStrategy().{name} is gone in Lightning {lightning.__version__}"


def test_loop_data_sources_and_module_trainer_exist():
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    for source in (trainer.fit_loop._data_source, trainer.fit_loop.epoch_loop.val_loop._data_source):
        assert callable(source.is_defined), f"Lightning {lightning.__version__}: {source!r}"
        assert callable(source.dataloader), f"Lightning {lightning.__version__}: {source!r}"
    assert LightningModule()._trainer is None


def test_the_trainer_holds_its_checkpoint_connector():
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    connector = trainer._checkpoint_connector
    assert callable(connector.resume_start) and callable(connector.dump_checkpoint)
