"""The modules ``ds_pipeline`` puts in place of the user's pipelined module on each process, and its stage classes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

# torch builds traced stages with this class (Pipe.build_stage); subclassed to record spans and checkpoint.
from torch.distributed.pipelining.stage import _PipelineStage
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


def _attach(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` at the dotted ``name`` under ``root``, making empty container modules on the way."""
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)


class PipelinedModule(nn.Module):
    """Stands in for the user's pipelined module, holding only this process's parameters under their original names.

    Keeping the names keeps ``state_dict()`` keys identical to the unsplit model's, so merging the stages' state dicts
    gives a checkpoint any Trainer loads. In a training step the strategy has already run the pipeline and primes the
    output here; in evaluation, calling it runs a forward-only pipeline on every rank.

    Args:
        layers: for an ``nn.Sequential``, this process's layers under their indices.
        evaluate: the forward-only pipeline, called with the module's inputs.
        tensors: for a traced module, this process's parameters and buffers by their names in the unsplit module.

    """

    def __init__(
        self,
        layers: Mapping[int, nn.Module],
        evaluate: Callable[..., torch.Tensor],
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        for index, layer in sorted(layers.items()):
            self.add_module(str(index), layer)
        for name, tensor in (tensors or {}).items():
            _attach(self, name, tensor)
        self._evaluate = evaluate
        self._traced = tensors is not None
        self._primed: torch.Tensor | None = None
        self._primed_calls = 0

    def prime(self, output: torch.Tensor) -> None:
        """Hand the pipeline's output of this training step to the user's ``training_step``."""
        # Plain attributes: written straight to __dict__, skipping nn.Module.__setattr__'s checks on every step.
        self.__dict__["_primed"], self.__dict__["_primed_calls"] = output, 0

    def unprime(self) -> None:
        """Forget the step's output."""
        self.__dict__["_primed"] = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Return the primed training output, or run a forward-only pipeline when gradients are off."""
        if not self._traced and (len(args) != 1 or kwargs):
            raise TypeError("Under ds_pipeline the pipelined nn.Sequential takes exactly one tensor argument.")
        if self._primed is not None:
            self.__dict__["_primed_calls"] += 1
            if self._primed_calls > 1:
                raise RuntimeError(
                    "Under ds_pipeline, training_step may call the pipelined module once per batch: the pipeline has "
                    "already run forward and backward for this batch's input."
                )
            rows = next((t.shape[0] for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)), None)
            if rows is not None and rows != self._primed.shape[0]:
                raise RuntimeError(
                    f"training_step called the pipelined module on {rows} rows, but the batch's input has "
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
        return self._evaluate(*args, **kwargs)


class _RecordedChunks:
    """Reports each forward and backward a stage runs to a :class:`SpanRecorder` (mixed into torch's stages).

    ``after_backward``, when set, is called with each full backward's micro-batch index once it has run: the runtime
    posts the receive of the pipeline's output there on the first stage, in the wait for the next gradient, instead
    of on the critical path before the schedule.
    """

    stage_index: int
    has_backward: bool
    _recorder: SpanRecorder | None
    after_backward: Callable[[int], None] | None = None

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self._recorder is None:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)  # type: ignore[misc]
        with self._recorder.span("forward", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)  # type: ignore[misc]

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self._recorder is None or not self.has_backward:
            output = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)  # type: ignore[misc]
        else:
            kind = "backward" if kwargs.get("full_backward", True) else "backward_input"  # torch passes keywords
            with self._recorder.span(kind, self.stage_index, bwd_chunk_id):
                output = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)  # type: ignore[misc]
        if self.after_backward is not None:
            self.after_backward(bwd_chunk_id)
        return output

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self._recorder is None or not self.has_backward:
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)  # type: ignore[misc]
        with self._recorder.span("backward_weight", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)  # type: ignore[misc]


class TracedStage(_RecordedChunks, PipelineStage):
    """A ``PipelineStage`` over a :class:`StageModule` that reports what it runs to a :class:`SpanRecorder`."""

    def __init__(self, *args: Any, recorder: SpanRecorder | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recorder = recorder


class GraphStage(_RecordedChunks, _PipelineStage):
    """A stage of a traced split (torch reads its inputs and outputs from the graph), recorded and checkpointable.

    Args:
        stage_module: the stage's ``GraphModule``.
        stage_index: its index in the pipeline.
        pipe_info: the traced pipeline's ``Pipe.info()``.
        device: this process's device.
        group: the pipeline's process group.
        recorder: reports spans to it, or ``None``.
        activation_checkpointing: recompute the stage's activations in the backward pass instead of storing them.

    """

    def __init__(
        self,
        stage_module: nn.Module,
        stage_index: int,
        pipe_info: Any,
        device: torch.device,
        group: Any = None,
        recorder: SpanRecorder | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__(stage_module, stage_index, pipe_info, device, group)
        self._recorder = recorder
        self._checkpointing = activation_checkpointing

    @classmethod
    def build(
        cls,
        pipe_info: Any,
        device: torch.device,
        group: Any,
        activation_checkpointing: bool,
        stage_index: int,
        stage_module: nn.Module,
        recorder: SpanRecorder | None,
    ) -> GraphStage:
        """The runtime's stage factory, once the first four arguments are bound."""
        return cls(stage_module, stage_index, pipe_info, device, group, recorder, activation_checkpointing)

    @override
    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        # No DDP wrapper here (replicas average in the runtime), so the stage module is called directly.
        if self._checkpointing and torch.is_grad_enabled():
            return checkpoint(self.submod, *args, use_reentrant=False, **kwargs)
        return self.submod(*args, **kwargs)
