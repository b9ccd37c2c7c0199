"""The modules ``ds_pipeline`` puts in place of the user's ``nn.Sequential`` on each process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from ds_lightning.pipeline.trace import SpanRecorder


class StageModule(nn.Module):
    """One pipeline stage: a contiguous run of the user's layers, optionally with activation checkpointing."""

    def __init__(self, layers: Sequence[nn.Module], activation_checkpointing: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.activation_checkpointing = activation_checkpointing

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the layers; recompute their activations in the backward pass when checkpointing is on."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._run, x, use_reentrant=False)
        return self._run(x)


class PipelinedSequential(nn.Module):
    """Stands in for the user's ``nn.Sequential``, holding only this process's layers under their original indices.

    Keeping the indices keeps ``state_dict()`` keys identical to the unsplit model's, so merging the stages' state
    dicts gives a checkpoint any Trainer loads. In a training step the strategy has already run the pipeline and
    primes the output here; in evaluation, calling it runs a forward-only pipeline on every rank.
    """

    def __init__(self, layers: dict[int, nn.Module], evaluate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        for index, layer in sorted(layers.items()):
            self.add_module(str(index), layer)
        self._evaluate = evaluate
        self._primed: torch.Tensor | None = None
        self._primed_calls = 0

    def prime(self, output: torch.Tensor) -> None:
        """Hand the pipeline's output of this training step to the user's ``training_step``."""
        self._primed, self._primed_calls = output, 0

    def unprime(self) -> None:
        """Forget the step's output."""
        self._primed = None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Return the primed training output, or run a forward-only pipeline when gradients are off."""
        if args or kwargs:
            raise TypeError("Under ds_pipeline the pipelined nn.Sequential takes exactly one tensor argument.")
        if self._primed is not None:
            self._primed_calls += 1
            if self._primed_calls > 1:
                raise RuntimeError(
                    "Under ds_pipeline, training_step may call the pipelined module once per batch: the pipeline has "
                    "already run forward and backward for this batch's input."
                )
            if x.shape[0] != self._primed.shape[0]:
                raise RuntimeError(
                    f"training_step called the pipelined module on {x.shape[0]} rows, but the batch's input has "
                    f"{self._primed.shape[0]}: under ds_pipeline it must be called on the input that pipeline_batch "
                    "returns."
                )
            return self._primed
        if torch.is_grad_enabled():
            raise RuntimeError(
                "Under ds_pipeline the pipelined module runs with gradients only inside training_step, where the "
                "strategy runs the pipeline schedule; call it under torch.no_grad() elsewhere (validation, test and "
                "predict already are)."
            )
        return self._evaluate(x)


class TracedStage(PipelineStage):
    """A ``PipelineStage`` that reports each forward and backward it runs to a :class:`SpanRecorder`."""

    def __init__(self, *args: Any, recorder: SpanRecorder | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recorder = recorder

    @override
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self._recorder is None:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        with self._recorder.span("forward", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    @override
    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self._recorder is None or not self.has_backward:
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        kind = "backward" if kwargs.get("full_backward", True) else "backward_input"  # torch's schedules pass keywords
        with self._recorder.span(kind, self.stage_index, bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    @override
    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self._recorder is None or not self.has_backward:
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        with self._recorder.span("backward_weight", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
