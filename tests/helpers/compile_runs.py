"""Fits of one small model under a ds strategy, eager or under ``torch.compile``, in one set of processes.

Usage: ``python -m tests.helpers.compile_runs SPEC.json`` on every rank (started together, as torchrun would), or once
for a strategy that launches its own processes (``ds_parameter_server``, one fit a launch: its servers leave after
it) or runs in one (``ds_model_parallel``, ``"single"``). The spec holds ``out`` (a folder) and ``runs``, a list of
fits, each with a ``name``, a ``strategy`` name (or ``"single"``: one process, no strategy) and its ``options``, and
optionally ``compile`` (``"module"``: ``torch.compile(model)``, Lightning's documented way; ``"submodule"``:
``model.net = torch.compile(model.net)``), ``backend`` (torch.compile's; default inductor), ``lr``, ``max_steps``,
``precision`` and ``slow_link`` (see :func:`slow_link`). For each fit rank 0 writes ``{name}.pt`` (the final
parameters, under the eager model's names) and ``{name}.json`` (the graphs it compiled, graph breaks, auto's
choices); where the fit raised, every rank writes ``{name}.rank{r}.error.txt`` (the exception's type and message)
and goes on to the next fit.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

import ds_lightning
from ds_lightning.comm.auto.hook import AutoState
from tests.helpers.auto_workers import SLOW

FEATURES, HIDDEN, CLASSES, SAMPLES, BATCH = 16, 32, 4, 64, 8


class CompileNet(pl.LightningModule):
    """``self.net`` an ``nn.Sequential`` with ``pipeline_loss``: the contract of every ds strategy, seeded in
    ``__init__``; ``training_step`` has no ``self.log`` or Python-side effect, so a compiled step has no graph break."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)
        )
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.pipeline_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


@contextlib.contextmanager
def slow_link() -> Iterator[None]:
    """Under ``gradient_compression="auto"``: decide on a slow link's figures (``override``) from the set-up decision
    on, so that auto compresses (on loopback it would keep ``none``).

    Set from the set-up decision, not from ``on_train_start``: that decision probes the real link, and on a loaded
    machine the probe sometimes made it choose fp16 in one run and ``none`` in its eager pair, which then trained
    differently. With the override from the start every decision of both runs sees the same figures.
    """
    original = AutoState.__post_init__

    def with_override(self: AutoState) -> None:
        original(self)
        self.override = SLOW

    AutoState.__post_init__ = with_override  # type: ignore[method-assign]
    try:
        yield
    finally:
        AutoState.__post_init__ = original  # type: ignore[method-assign]


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ w).argmax(1))


def make_strategy(name: str, options: dict[str, Any]) -> Any:
    timeout = {"timeout": timedelta(seconds=120)}
    if name == "ds_mirrored":
        return ds_lightning.MirroredStrategy(**timeout, **options)
    if name == "ds_pipeline":
        return ds_lightning.PipelineStrategy(**timeout, **options)
    if name == "ds_parameter_server":
        return ds_lightning.ParameterServerStrategy(**timeout, **options)
    if name == "single":
        return "auto"
    if name == "ds_model_parallel":
        return ds_lightning.LayerSplitStrategy(**options)
    raise ValueError(f"unknown strategy {name!r}")


def eager_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters under the eager model's names (a compiled submodule adds ``_orig_mod.`` to its keys)."""
    return {k.replace("_orig_mod.", ""): v.detach().clone() for k, v in state.items()}


def fit(run: dict[str, Any], out: Path) -> None:
    torch._dynamo.reset()  # each fit compiles its own graphs (dynamo caches them per code object), counted below
    counters.clear()
    model = CompileNet(lr=run.get("lr", 0.1))
    fitted: Any = model
    how, backend = run.get("compile"), run.get("backend", "inductor")
    if how == "module":
        fitted = torch.compile(model, backend=backend)
    elif how == "submodule":
        model.net = torch.compile(model.net, backend=backend)  # type: ignore[assignment]
    single = run["strategy"] in ("ds_model_parallel", "single")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if single else 2,
        strategy=make_strategy(run["strategy"], run.get("options", {})),
        precision=run.get("precision", "32-true"),
        max_steps=run.get("max_steps", 3),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    rank = trainer.global_rank
    try:
        # "single": one process on the global batch, what ds_parameter_server's bulk-synchronous training equals.
        batch = 2 * BATCH if run["strategy"] == "single" else BATCH
        with slow_link() if run.get("slow_link") else contextlib.nullcontext():
            trainer.fit(fitted, DataLoader(make_data(), batch_size=batch))
    except Exception as err:
        (out / f"{run['name']}.rank{rank}.error.txt").write_text(f"{type(err).__name__}: {err}")
        return
    if rank == 0 and not getattr(trainer.strategy, "is_server", False):
        torch.save(eager_names(model.state_dict()), out / f"{run['name']}.pt")
        auto = getattr(trainer.strategy, "auto_compression", None)
        record = {
            "graphs": counters["stats"]["unique_graphs"],  # the graphs rank 0 compiled in this fit
            "graph_breaks": sum(counters["graph_break"].values()),
            "auto_choices": [d.choice for d in auto.decisions] if auto is not None else [],
        }
        (out / f"{run['name']}.json").write_text(json.dumps(record))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    out = Path(spec["out"])
    for run in spec["runs"]:
        fit(run, out)


if __name__ == "__main__":
    main(sys.argv[1])
