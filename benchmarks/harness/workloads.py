"""The benchmarks' two workloads (``--model digits|gpt``): the digits MLP, and the byte-level GPT on the standard
library's source text. A worker builds the one its spec's ``"workload"`` (:func:`spec_of`) names."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from ds_lightning.demos import GPT, TextDataModule, load_digits_tensors, make_mlp

MODELS = ("digits", "gpt")
GPT_DEFAULTS = {"n_layer": 4, "n_head": 4, "d_model": 128, "block_size": 128}


@dataclass
class Workload:
    """What a worker trains: ``net`` (an ``nn.Sequential``, pipeline-ready), its data and its loss."""

    name: str
    net: nn.Sequential
    train_set: Dataset
    val_set: Dataset
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    tokens_per_sample: int
    unit: str  # "samples" or "tokens": what throughput counts

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.net.parameters())


def _token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def build(workload: dict[str, Any], hidden: list[int] | None = None, seed: int = 0) -> Workload:
    """The workload a spec names, its parameters initialised from ``seed`` (every process starts from one model)."""
    torch.manual_seed(seed)
    if workload["model"] == "digits":
        x, y = load_digits_tensors()
        data = TensorDataset(x, y)
        net = make_mlp(64, hidden or [1024, 1024], 10)
        return Workload("digits", net, data, data, F.cross_entropy, 1, "samples")
    if workload["model"] == "gpt":
        shape = {**GPT_DEFAULTS, **{k: v for k, v in workload.items() if k in GPT_DEFAULTS}}
        text = TextDataModule(block_size=shape["block_size"], seed=seed)
        text.setup("fit")
        assert text.train_set is not None and text.val_set is not None
        net = cast(nn.Sequential, GPT(**shape).net)  # GPT's net is an nn.Sequential (TiedGPT's is not)
        return Workload("gpt", net, text.train_set, text.val_set, _token_loss, shape["block_size"], "tokens")
    raise ValueError(f"model={workload['model']!r}: choose one of {MODELS}")


def add_options(parser: argparse.ArgumentParser) -> None:
    """The GPT's shape options (``--model`` itself is the harness's)."""
    parser.add_argument("--gpt-layers", type=int, default=GPT_DEFAULTS["n_layer"], help="GPT blocks (4)")
    parser.add_argument("--gpt-heads", type=int, default=GPT_DEFAULTS["n_head"], help="GPT attention heads (4)")
    parser.add_argument("--gpt-width", type=int, default=GPT_DEFAULTS["d_model"], help="GPT d_model (128)")
    parser.add_argument("--gpt-block", type=int, default=GPT_DEFAULTS["block_size"], help="GPT context (128)")


def spec_of(opts: argparse.Namespace) -> dict[str, Any]:
    """The ``"workload"`` entry of a worker's spec, from the command line."""
    if getattr(opts, "model", "digits") != "gpt":
        return {"model": "digits"}
    return {
        "model": "gpt",
        "n_layer": opts.gpt_layers,
        "n_head": opts.gpt_heads,
        "d_model": opts.gpt_width,
        "block_size": opts.gpt_block,
    }


def fill_defaults(
    opts: argparse.Namespace, full: dict[str, dict[str, Any]], quick: dict[str, dict[str, Any]]
) -> argparse.Namespace:
    """Set the options still ``None`` from ``full[model]``, overridden by ``quick[model]`` under ``--quick``."""
    model = getattr(opts, "model", "digits")
    for key, value in {**full[model], **(quick.get(model, {}) if opts.quick else {})}.items():
        if getattr(opts, key, None) is None:
            setattr(opts, key, value)
    return opts


def label(workload: dict[str, Any], hidden: list[int] | None = None) -> str:
    """A results page's name for the workload."""
    if workload["model"] == "gpt":
        shape = {**GPT_DEFAULTS, **workload}
        return (
            f"byte-level GPT ({shape['n_layer']} layers, d_model {shape['d_model']}, {shape['n_head']} heads,"
            f" context {shape['block_size']}) on the standard library's source text"
        )
    return f"digits MLP 64-{'-'.join(str(h) for h in hidden or [1024, 1024])}-10"
