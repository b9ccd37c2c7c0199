"""The runtime: torch's pipeline schedules run inside Lightning's loop.

One (stages, schedule) pair per input shape, the output broadcast to every stage, forward-only evaluation, and the
gradients parked between ``training_step`` and ``backward``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.pipelining.stage import _PipelineStageBase

from ds_lightning.pipeline import microbatch
from ds_lightning.pipeline.layout import PipelineLayout
from ds_lightning.pipeline.mesh import PipelineGroups
from ds_lightning.pipeline.schedules import ScheduleSpec, make_forward_only
from ds_lightning.pipeline.stage import TracedStage, _RecordedChunks
from ds_lightning.pipeline.trace import SpanRecorder, render_timeline_png, write_chrome_trace

__all__ = ["PipelineRuntime", "StageFactory", "TiedWeight", "write_trace"]

#: Builds torch's stage object for (stage index, stage module, recorder or None).
StageFactory = Callable[[int, nn.Module, SpanRecorder | None], _PipelineStageBase]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
_HEADER = 10  # ndim, dtype, up to 8 dims


class _Pipeline:
    """The stages and schedule for one (mode, input shape); built lazily, identically on every rank of a pipeline."""

    def __init__(self, stages: list[_PipelineStageBase], schedule: Any) -> None:
        self.schedule = schedule
        self.has_first = any(stage.is_first for stage in stages)
        self.has_last = any(stage.is_last for stage in stages)
        # Set when the first stage posts the output's receive after its first backward (see PipelineRuntime._run).
        self.posts_in_backward = False
        # The output's shape and dtype, learnt on the first step; like the activations torch infers once, they are
        # fixed for a given input shape.
        self.output_meta: tuple[list[int], torch.dtype] | None = None


class TiedWeight:
    """A weight that several stages use (a head tied to the embedding): its shape, and this process's copies.

    Args:
        shape: the weight's shape.
        dtype: its dtype.
        copies: this process's copies, one per local stage that uses it (none when no stage here does).
        duplicates: the copies gradient norms must skip: all but the copy of the weight's first stage.

    """

    def __init__(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        copies: Sequence[nn.Parameter] = (),
        duplicates: Sequence[nn.Parameter] = (),
    ) -> None:
        self.shape, self.dtype = shape, dtype
        self.copies, self.duplicates = list(copies), list(duplicates)


def _rows(inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    return next(t.shape[0] for t in [*inputs, *kwargs.values()] if isinstance(t, torch.Tensor))


class PipelineRuntime:
    """This process's stages, and the schedules that run them; every call is collective over the pipeline's ranks.

    Args:
        stages: this process's stage modules by stage index.
        layout: the run's degrees.
        spec: the torch schedule.
        n_microbatches: micro-batches per batch.
        groups: the run's process groups.
        device: this process's device.
        loss_fn: the training loss of one micro-batch, ``loss_fn(output, target)``.
        recorder: records the executed training schedule, or ``None``.
        make_stage: builds torch's stage object; ``None`` for :class:`TracedStage` over a layer list.
        microbatch_rows: a traced split's fixed micro-batch size: evaluation batches are padded to whole micro-batches
            of it (shapes were fixed when tracing); ``None`` pads to a multiple of ``n_microbatches`` instead.
        tied: weights whose gradients are summed over the pipeline's stages each step.

    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        layout: PipelineLayout,
        spec: ScheduleSpec,
        n_microbatches: int,
        groups: PipelineGroups,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        recorder: SpanRecorder | None = None,
        make_stage: StageFactory | None = None,
        microbatch_rows: int | None = None,
        tied: Sequence[TiedWeight] = (),
    ) -> None:
        self.stages = stages
        self.layout = layout
        self.spec = spec
        self.n_microbatches = n_microbatches
        self.groups = groups
        self.device = device
        self.loss_fn = loss_fn
        self.recorder = recorder
        self.make_stage = make_stage or self._layer_stage
        self.microbatch_rows = microbatch_rows
        self.tied = list(tied)
        self._pipelines: dict[tuple[Any, ...], _Pipeline] = {}
        self._warned_sizes: set[int] = set()
        self._fresh_grads: tuple[list[nn.Parameter], list[torch.Tensor | None]] | None = None
        self._awaited_output: torch.Tensor | None = None  # this step's output buffer until its receive is posted
        self._pending_output: Any = None  # the posted receive
        last = layout.stages - 1
        owner = next(r for r in range(layout.pipeline_size) if last in layout.stage_indices(r, spec.style))
        self._output_source = dist.get_global_rank(groups.pipeline, owner)

    def _layer_stage(self, s: int, module: nn.Module, recorder: SpanRecorder | None) -> _PipelineStageBase:
        return TracedStage(module, s, self.layout.stages, self.device, group=self.groups.pipeline, recorder=recorder)

    def _pipeline(self, mode: str, inputs: Sequence[Any], kwargs: Mapping[str, Any], n_microbatches: int) -> _Pipeline:
        shapes = tuple((tuple(t.shape), t.dtype) for t in [*inputs, *kwargs.values()] if isinstance(t, torch.Tensor))
        key = (mode, shapes, tuple(kwargs), n_microbatches, torch.is_inference_mode_enabled())
        if key in self._pipelines:
            return self._pipelines[key]
        training = mode == "train"
        recorder = self.recorder if training else None
        stages = [self.make_stage(s, module, recorder) for s, module in self.stages.items()]
        loss_fn = self.loss_fn if training else None
        kwargs = {"n_microbatches": n_microbatches, "loss_fn": loss_fn, "scale_grads": False}
        torch_class = self.spec.torch_class
        schedule = torch_class(stages, **kwargs) if self.spec.multi_stage else torch_class(stages[0], **kwargs)
        if not training and self.spec.style == "v":
            make_forward_only(schedule)
        pipeline = self._pipelines[key] = _Pipeline(stages, schedule)
        if training and pipeline.has_first and not pipeline.has_last:
            first = next(stage for stage in stages if stage.is_first)
            if isinstance(first, _RecordedChunks):
                first.after_backward = self._post_output
                pipeline.posts_in_backward = True
        return pipeline

    def _broadcast(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        return dist.broadcast(tensor, src=self._output_source, group=self.groups.output, async_op=async_op)

    def _learn_output_meta(self, output: torch.Tensor | None, pipeline: _Pipeline) -> tuple[list[int], torch.dtype]:
        """On a pipeline's first run, tell every stage the output's shape and dtype (fixed per input shape after)."""
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        valid = isinstance(output, torch.Tensor) and output.dim() <= _HEADER - 2 and output.dtype in _DTYPES
        if pipeline.has_last:
            if valid:
                assert isinstance(output, torch.Tensor)
                header[0], header[1] = output.dim(), _DTYPES.index(output.dtype)
                header[2 : 2 + output.dim()] = torch.tensor(output.shape)
            else:
                header[0] = -1  # every stage raises, instead of the others waiting for data that never comes
        self._broadcast(header)
        if int(header[0]) < 0:
            raise TypeError(
                "ds_pipeline needs the last layer to return one tensor (of at most 8 dims and a standard dtype); "
                f"the last stage returned {type(output).__name__ if pipeline.has_last else 'something else'}."
            )
        pipeline.output_meta = (header[2 : 2 + int(header[0])].tolist(), _DTYPES[int(header[1])])
        return pipeline.output_meta

    def _run(
        self, pipeline: _Pipeline, inputs: Sequence[Any], kw: Mapping[str, Any], target: torch.Tensor | None
    ) -> torch.Tensor:
        """Run the schedule and return the last stage's output on every stage of the pipeline.

        The ranks without the last stage receive the output by a broadcast posted before the schedule, so that it
        overlaps with their work. The first stage is the exception: it starts each step and ends it (its backward is
        the last), so every microsecond it spends outside the schedule lengthens the step; it posts the receive after
        its first backward instead, while it waits for the next gradient.
        """
        args = tuple(inputs) if pipeline.has_first else ()
        kwargs: dict[str, Any] = dict(kw) if pipeline.has_first else {}
        if target is not None and pipeline.has_last:
            kwargs["target"] = target
        received: torch.Tensor | None = None
        self._pending_output = None
        if pipeline.output_meta is not None and not pipeline.has_last:
            shape, dtype = pipeline.output_meta
            received = torch.empty(shape, dtype=dtype, device=self.device)
            if target is not None and pipeline.posts_in_backward:
                self._awaited_output = received  # posted by _post_output, from the first stage's first backward
            else:
                self._pending_output = self._broadcast(received, async_op=True)
        run = pipeline.schedule.eval if target is None else pipeline.schedule.step
        try:
            output = run(*args, **kwargs)
        finally:
            self._awaited_output = None
        if pipeline.output_meta is None:
            shape, dtype = self._learn_output_meta(output, pipeline)
            received = None if pipeline.has_last else torch.empty(shape, dtype=dtype, device=self.device)
        if pipeline.has_last:
            assert pipeline.output_meta is not None  # learnt above on the first run
            shape, dtype = pipeline.output_meta
            if list(output.shape) != shape or output.dtype != dtype:
                raise RuntimeError(
                    f"The pipeline's output changed from {shape} {dtype} to {list(output.shape)} {output.dtype} for "
                    "the same input shape; ds_pipeline needs a fixed output shape per input shape."
                )
            output = output.detach().contiguous()
            self._broadcast(output)
            return output
        assert received is not None
        # Not posted yet: the first run (the shape was unknown), or a schedule that ran no backward here.
        pending = self._pending_output if self._pending_output is not None else self._broadcast(received, async_op=True)
        self._pending_output = None
        pending.wait()
        return received

    def _post_output(self, chunk: int) -> None:
        """Called after each backward of the first stage: the first one posts the receive of the step's output."""
        if self._awaited_output is not None and self._pending_output is None:
            self._pending_output = self._broadcast(self._awaited_output, async_op=True)

    def evaluate(self, *inputs: Any, **kw: Any) -> torch.Tensor:
        """Forward-only pipeline; pads the rows to whole micro-batches and cuts the padding off again."""
        rows = _rows(inputs, kw)
        n = self.n_microbatches
        if self.microbatch_rows is None:
            target_rows = rows + (-rows) % n
        else:
            # A traced split's shapes are fixed: whole micro-batches of the traced size, at least n_microbatches.
            n = max(n, -(-rows // self.microbatch_rows))
            target_rows = n * self.microbatch_rows
        inputs, kw = microbatch.pad_inputs(inputs, kw, target_rows)
        if target_rows != rows and rows not in self._warned_sizes:
            self._warned_sizes.add(rows)
            rank_zero_info(
                f"ds_pipeline: an evaluation batch of {rows} rows is padded to {target_rows} ({n} micro-batches); "
                "the padding rows are cut from the outputs."
            )
        pipeline = self._pipeline("eval", inputs, kw, n)
        return self._run(pipeline, inputs, kw, None)[:rows]

    def train(
        self, inputs: Sequence[Any], kw: Mapping[str, Any], target: torch.Tensor, params: Sequence[nn.Parameter]
    ) -> torch.Tensor:
        """Run forward and backward over the batch; its gradients are parked until :meth:`hand_over`.

        Lightning zeroes gradients after ``training_step`` and before ``backward``, so the schedule's new gradients
        wait here and ``params`` keep the ones they had.
        """
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        rows = _rows(inputs, kw)
        if self.microbatch_rows is not None and rows != self.microbatch_rows * self.n_microbatches:
            raise RuntimeError(
                f"A training batch of {rows} rows does not split into n_microbatches={self.n_microbatches} "
                f"micro-batches of {self.microbatch_rows} rows, the size the model was traced with; a traced pipeline "
                "keeps its shapes. Give every training batch the same size (DataLoader(drop_last=True))."
            )
        output = self._run(self._pipeline("train", inputs, kw, self.n_microbatches), inputs, kw, target)
        self._fresh_grads = (list(params), [p.grad for p in params])
        for p, grad in zip(params, earlier, strict=True):
            p.grad = grad
        return output

    def hand_over(self) -> None:
        """Add the parked gradients to the parameters :meth:`train` ran with, averaged over the replicas first.

        A collective over the replicas when there are several.

        Raises:
            RuntimeError: when no training step has parked any (a second backward, or ``manual_backward``).

        """
        parked, self._fresh_grads = self._fresh_grads, None
        if parked is None:
            raise RuntimeError(
                "ds_pipeline computes gradients in the pipeline schedule of training_step; manual_backward or a second "
                "backward per step has no new gradients to apply."
            )
        params, fresh = parked
        grads = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, fresh, strict=True)]
        self._sum_tied(params, grads)
        replicas = self.layout.data_parallel_size
        if replicas > 1 and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.groups.data)
            flat /= replicas
            grads = [chunk.view_as(g) for chunk, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad if p.grad is None else p.grad + grad

    def duplicate_copies(self) -> list[nn.Parameter]:
        """This process's copies of tied weights whose gradient an earlier stage's copy already counts (for norms)."""
        return [p for w in self.tied for p in w.duplicates]

    def _sum_tied(self, params: Sequence[nn.Parameter], grads: list[torch.Tensor]) -> None:
        """Sum the gradients of each tied weight's copies over the stages (collective over the pipeline).

        Each stage holding a copy computed only its own use's gradient; the sum is the gradient of the one weight, as
        Megatron does for tied embeddings, so the copies stay equal after every optimizer step.
        """
        if not self.tied:
            return
        position = {id(p): i for i, p in enumerate(params)}
        parts = []
        for weight in self.tied:
            # Two stages on this process (a V schedule) each hold a copy: their gradients are summed here first.
            part = torch.zeros(weight.shape.numel(), dtype=weight.dtype, device=self.device)
            for copy in weight.copies:
                if id(copy) in position:
                    part += grads[position[id(copy)]].reshape(-1)
            parts.append(part)
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=self.groups.pipeline)
        for weight, chunk in zip(self.tied, flat.split([w.shape.numel() for w in self.tied]), strict=True):
            for copy in weight.copies:
                if id(copy) in position:
                    index = position[id(copy)]
                    grads[index] = chunk.view_as(grads[index]).clone()


def write_trace(recorder: SpanRecorder, world_size: int, global_rank: int, path: str | None, title: str) -> None:
    """Gather every rank's spans (a collective) and, on rank 0, write the Chrome trace and the PNG timeline."""
    payloads: list[Any] = [None] * world_size
    dist.all_gather_object(payloads, recorder.to_payload())
    if global_rank != 0 or path is None:
        return
    spans = [span for payload in payloads for span in SpanRecorder.from_payload(payload)]
    written = write_chrome_trace(spans, path)
    rank_zero_info(f"ds_pipeline: wrote the schedule trace of {len(spans)} spans to {written}")
    try:
        png = render_timeline_png(spans, written.with_suffix(".png"), title=title)
        rank_zero_info(f"ds_pipeline: timeline at {png}")
    except ImportError as err:
        rank_zero_warn(f"ds_pipeline: no PNG timeline ({err}).")
