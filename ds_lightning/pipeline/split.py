"""Splitting a LightningModule's ``nn.Sequential`` into pipeline stages: the contract, the sample input, the checks."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from ds_lightning.pipeline.layout import PipelineLayout

__all__ = ["check_contract", "check_every_rank_trains", "sample_input", "split_batch", "user_sequential"]


def user_sequential(module: LightningModule, attribute: str) -> nn.Sequential:
    """The ``nn.Sequential`` to pipeline.

    Raises:
        TypeError: when the attribute is missing or not an ``nn.Sequential``, naming the fix.

    """
    seq = getattr(module, attribute, None)
    if not isinstance(seq, nn.Sequential):
        found = "no such attribute" if seq is None else f"a {type(seq).__name__}"
        raise TypeError(
            f"ds_pipeline splits the nn.Sequential `{type(module).__name__}.{attribute}`, but found "
            f"{found}. Put the layers to pipeline in `self.{attribute} = nn.Sequential(...)`, or name the "
            "attribute with PipelineStrategy(pipe_module=...)."
        )
    return seq


def check_contract(module: LightningModule, attribute: str, fitting: bool) -> None:
    """For training: the module has ``pipeline_loss``, and every trainable parameter is inside the pipeline.

    Raises:
        TypeError: without ``pipeline_loss``.
        ValueError: naming the trainable parameters outside the pipelined ``nn.Sequential``.

    """
    if not fitting:
        return
    if not callable(getattr(module, "pipeline_loss", None)):
        raise TypeError(
            f"ds_pipeline computes the loss on the last stage with `{type(module).__name__}.pipeline_loss(output, "
            "target)`, which is missing. Add e.g. `def pipeline_loss(self, output, target): return "
            "F.cross_entropy(output, target)` and use it in training_step too."
        )
    seq = getattr(module, attribute)
    inside = {id(p) for p in seq.parameters()}
    outside = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"ds_pipeline trains only the parameters inside `{attribute}`, but {outside[:5]} are outside it "
            f"and would never be updated. Move those layers into `self.{attribute}` (nn.Sequential)."
        )


def check_every_rank_trains(seq: nn.Sequential, ranges: list[range], layout: PipelineLayout, style: str) -> None:
    """Refuse a split that leaves a process with no trainable parameter: its optimizer would be empty.

    Raises:
        ValueError: naming the process, its layers and the fix.

    """
    for rank in range(layout.pipeline_size):
        layers = [i for s in layout.stage_indices(rank, style) for i in ranges[s]]
        if not any(p.requires_grad for i in layers for p in seq[i].parameters()):
            kinds = ", ".join(type(seq[i]).__name__ for i in layers)
            raise ValueError(
                f"Pipeline process {rank} would hold only layers {layers} ({kinds}), which have no trainable "
                "parameters, so its optimizer would be empty. Give it a layer with parameters through `balance` "
                "(e.g. keep each activation with the layer before it), or use fewer stages."
            )


def split_batch(module: LightningModule, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as ``(input, target)``, through ``module.pipeline_batch`` when the module defines it.

    Raises:
        TypeError: naming the batch's type and the method to define.

    """
    split = getattr(module, "pipeline_batch", None)
    pair = split(batch) if callable(split) else batch
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], torch.Tensor):
        raise TypeError(
            f"ds_pipeline needs each batch as (input, target), got {type(batch).__name__}; define "
            f"`{type(module).__name__}.pipeline_batch(batch) -> (input, target)` to say how to split it."
        )
    return pair[0], pair[1]


def sample_input(trainer: Trainer, module: LightningModule) -> torch.Tensor:
    """The input ``balance="auto"`` profiles on: ``example_input_array``, else the first training batch's input.

    Raises:
        ValueError: when there is neither, naming both fixes.

    """
    sample = module.example_input_array
    if isinstance(sample, torch.Tensor):
        return sample
    if trainer.state.fn == TrainerFn.FITTING:
        source = trainer.fit_loop._data_source
        if source.is_defined():
            loader = source.dataloader()
            batch = next(iter(loader))
            return split_batch(module, batch)[0]
    raise ValueError(
        "balance='auto' profiles the layers on a sample input: set `self.example_input_array` in your "
        "LightningModule, or give an explicit balance such as balance=[3, 2]."
    )
