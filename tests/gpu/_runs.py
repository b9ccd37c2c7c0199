"""One training on CUDA (or its CPU reference) from a JSON spec; Lightning relaunches this script for every rank.

Usage: ``python -m tests.gpu._runs SPEC.json``. The spec names a strategy by its registry name (``"ds_mirrored"``,
``"ds_pipeline"``, ``"ds_parameter_server"``; ``"single"`` for one plain device), its options, the accelerator and
devices. Every training rank writes ``{out}.rank{r}.pt``: its per-step losses, final parameters (on CPU), the devices
and dtypes its parameters had while training, and the process group's backend. With ``"save_params": true`` the final
parameters are gathered as training ends instead (:class:`~tests.helpers.callbacks.SaveParams`, whole where sharded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ds_lightning  # noqa: F401  (registers the ds_* strategy names)
from tests.helpers.callbacks import SaveParams

FEATURES, CLASSES = 16, 4


def make_data(n: int = 256) -> TensorDataset:
    """A learnable problem: labels from a fixed random linear map."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ w).argmax(1))


class Net(pl.LightningModule):
    """Follows the ds_pipeline and ds_model_parallel contract: ``self.net`` (an ``nn.Sequential``) and
    ``pipeline_loss``. Plain SGD, so a server-side or split optimizer has the same numerics as one process."""

    def __init__(self, lr: float = 0.5, depth: int = 2, momentum: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(FEATURES, FEATURES), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(FEATURES, CLASSES))
        self.lr, self.momentum = lr, momentum
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class RecordDevices(Callback):
    """The devices and dtypes of the parameters this rank holds, seen after its first training batch."""

    def __init__(self) -> None:
        self.devices: list[str] = []
        self.dtypes: list[str] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.devices:
            params = list(pl_module.parameters())
            self.devices = sorted({str(p.device) for p in params})
            self.dtypes = sorted({str(p.dtype) for p in params})


def build_strategy(name: str, options: dict[str, Any]) -> Any:
    """The registered strategy ``name`` with ``options`` on top of its registered defaults."""
    if name == "single":
        return "auto"
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **options})


def run(spec: dict[str, Any]) -> None:
    pl.seed_everything(0, verbose=False)
    model = Net(**spec.get("model", {}))
    record = RecordDevices()
    trainer = pl.Trainer(
        accelerator=spec["accelerator"],
        devices=spec.get("devices", 1),
        strategy=build_strategy(spec["strategy"], spec.get("options", {})),
        max_steps=spec["steps"],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        # Sharded parameters (FSDP2) are gathered whole while training ends, into {out}.params.rank{r}.pt.
        callbacks=[record, SaveParams(f"{spec['out']}.params")] if spec.get("save_params") else [record],
        default_root_dir=str(Path(spec["out"]).parent),
    )
    data = make_data()
    strategy = trainer.strategy
    sampler = None
    if not getattr(strategy, "is_server", False) and trainer.world_size > 1:
        # Replica r reads rows r, r+R, ...: one step of all replicas covers one reference batch of R times the size.
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
    loader = DataLoader(data, batch_size=spec["batch_size"], sampler=sampler, shuffle=False)
    trainer.fit(model, loader)
    if getattr(strategy, "is_server", False):
        return
    final = None if spec.get("save_params") else {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    result = {
        "losses": model.losses,
        "final": final,
        "devices": record.devices,
        "dtypes": record.dtypes,
        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
        "global_step": trainer.global_step,
        "world_size": trainer.world_size,
    }
    torch.save(result, f"{spec['out']}.rank{trainer.global_rank}.pt")


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    run(json.loads(Path(spec_path).read_text()))


if __name__ == "__main__":
    main(sys.argv[1])
