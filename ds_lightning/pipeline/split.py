"""Splitting a LightningModule's ``nn.Sequential`` into pipeline stages: the contract, the sample input, the checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from ds_lightning.pipeline.compiled import refuse_compiled_part
from ds_lightning.pipeline.layout import PipelineLayout

__all__ = [
    "as_call",
    "check_contract",
    "check_every_rank_trains",
    "first_microbatch",
    "is_traceable",
    "sample_batch_input",
    "sample_input",
    "split_batch",
    "user_sequential",
]


def user_sequential(module: LightningModule, attribute: str) -> nn.Sequential:
    """The ``nn.Sequential`` to pipeline.

    Raises:
        ValueError: when the attribute is a ``torch.compile``'d module (see :mod:`ds_lightning.pipeline.compiled`).
        TypeError: when the attribute is missing or not an ``nn.Sequential``, naming the fix.

    """
    refuse_compiled_part("ds_pipeline", module, attribute)
    seq = getattr(module, attribute, None)
    if not isinstance(seq, nn.Sequential):
        found = "no such attribute" if seq is None else f"a {type(seq).__name__}"
        raise TypeError(
            f"ds_pipeline splits the module `{type(module).__name__}.{attribute}`, but found {found}. Put the "
            f"layers to pipeline in `self.{attribute}`: an nn.Sequential, or any module with a forward (traced and "
            "cut by split_points); or name the attribute with PipelineStrategy(pipe_module=...)."
        )
    return seq


def is_traceable(value: object) -> bool:
    """Whether ``value`` is a module with its own ``forward`` (not a container such as ``nn.ModuleList``)."""
    return isinstance(value, nn.Module) and type(value).forward is not nn.Module.forward


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


def split_batch(module: LightningModule, batch: Any) -> tuple[Any, torch.Tensor]:
    """A batch as ``(input, target)``, through ``module.pipeline_batch`` when the module defines it.

    The input is a tensor, a tuple of tensors (positional inputs) or a dict of them (keyword inputs).

    Raises:
        TypeError: naming the batch's type and the method to define.

    """
    split = getattr(module, "pipeline_batch", None)
    pair = split(batch) if callable(split) else batch
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not _is_input(pair[0]):
        raise TypeError(
            f"ds_pipeline needs each batch as (input, target), the input a tensor, a tuple of tensors or a dict of "
            f"them, got {type(batch).__name__}; define `{type(module).__name__}.pipeline_batch(batch) -> (input, "
            "target)` to say how to split it."
        )
    return pair[0], pair[1]


def _is_input(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    values = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else None
    return values is not None and any(isinstance(v, torch.Tensor) for v in values)


def as_call(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch's input as the positional and keyword arguments of the pipelined module's ``forward``."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def first_microbatch(args: tuple[Any, ...], kwargs: dict[str, Any], n_microbatches: int) -> tuple[Any, Any]:
    """The first of ``n_microbatches`` micro-batches of the inputs: every tensor's leading rows, the rest as is."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value[: value.shape[0] // n_microbatches]
        return value

    return tuple(cut(v) for v in args), {k: cut(v) for k, v in kwargs.items()}


def sample_batch_input(trainer: Trainer, module: LightningModule, fix: str) -> Any:
    """A sample input: ``example_input_array``, else the first training batch's input.

    Raises:
        ValueError: when there is neither, naming both fixes (``fix`` is the alternative to a sample).

    """
    sample = module.example_input_array
    if sample is not None:
        return sample
    if trainer.state.fn == TrainerFn.FITTING:
        source = trainer.fit_loop._data_source
        if source.is_defined():
            loader = source.dataloader()
            batch = next(iter(loader))
            return split_batch(module, batch)[0]
    raise ValueError(
        f"ds_pipeline needs a sample input here: set `self.example_input_array` in your LightningModule, or {fix}."
    )


def sample_input(trainer: Trainer, module: LightningModule) -> torch.Tensor:
    """The input ``balance="auto"`` profiles an ``nn.Sequential`` on.

    Raises:
        ValueError: when there is none, naming the fixes.

    """
    sample = sample_batch_input(trainer, module, "give an explicit balance such as balance=[3, 2]")
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f"An nn.Sequential pipeline takes one tensor input, but the sample is {type(sample).__name__}.")
    return sample
