"""A callback that records, inside every ds_pipeline process, which torch schedule ran and every forward of a layer.

Used through ``ds-train`` (``--trainer.callbacks+=tests.helpers.pipeline_probes.RecordPipeline``); every rank writes
``{path}.rank{R}.json`` at the end of fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback


def _stage_indices(schedule: Any) -> list[int]:
    # Multi-stage schedules keep a list of stages; single-stage ones keep one.
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return [int(stage.stage_index) for stage in stages]


class RecordPipeline(Callback):
    """Record the schedule objects the strategy built and each forward call of this process's layers.

    The JSON holds ``schedules``: ``{mode: {"class": "module.Class", "stages": [...]}}`` for each pipeline the strategy
    built (``mode`` is ``"train"`` or ``"eval"``), ``calls``: one ``[phase, step, layer, rows, device, grad]`` per
    forward of a layer of the pipelined ``nn.Sequential`` that this process holds, and ``posted_in_backward``: the
    training steps whose output receive this process posted from a backward (the first stage's, once the output's
    shape is known).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls: list[list[Any]] = []
        self.posted_in_backward: list[int] = []  # the steps whose output receive a backward of this rank posted
        self.schedules: dict[str, dict[str, Any]] = {}
        self._phase, self._step = "setup", -1
        self._handles: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runtime = getattr(trainer.strategy, "_runtime", None)  # None under the other strategies pipeline_runs runs
        if runtime is not None:
            post = runtime._post_output  # the first stage's stage object binds it when the training pipeline is built

            def record_post(chunk: int) -> None:
                before = runtime._pending_output
                post(chunk)
                if before is None and runtime._pending_output is not None:
                    self.posted_in_backward.append(self._step)

            runtime._post_output = record_post
        # After setup the module's attribute holds only this process's layers, under their original indices.
        held = getattr(pl_module, trainer.strategy.pipe_module)
        for name, layer in held.named_children():

            def record(module: torch.nn.Module, args: Any, index: int = int(name)) -> None:
                x = args[0]
                self.calls.append([self._phase, self._step, index, x.shape[0], x.device.type, torch.is_grad_enabled()])

            self._handles.append(layer.register_forward_pre_hook(record))

    def _snapshot(self, trainer: pl.Trainer) -> None:
        runtime = trainer.strategy._runtime  # the schedules built so far, by phase; teardown clears them
        for key, pipeline in (runtime._pipelines if runtime is not None else {}).items():
            cls = type(pipeline.schedule)
            entry = {"class": f"{cls.__module__}.{cls.__qualname__}", "stages": _stage_indices(pipeline.schedule)}
            self.schedules[key[0]] = entry

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._phase, self._step = "train", trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._snapshot(trainer)
        self._phase = "between"

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._phase = "val"

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._snapshot(trainer)
        self._phase = "between"

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        record = {"global_step": trainer.global_step, "schedules": self.schedules, "calls": self.calls}
        record["posted_in_backward"] = self.posted_in_backward
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(record))
