"""Splitting any module into pipeline stages with torch's tracing frontend (``torch.distributed.pipelining.pipeline``).

The ``nn.Sequential`` path cuts a list of one-tensor layers; this one traces the module's ``forward`` once on a sample
micro-batch (``torch.export``) and cuts the graph before each named submodule, so stages may take several tensors and
keyword inputs, and weights used on two stages (a head tied to the embedding) are found for us
(``Pipe.replicated_params``). What comes out per stage is a ``GraphModule`` whose parameters are the module's own
``nn.Parameter`` objects under their original names, which keeps checkpoints keyed as the unsplit model.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from ds_lightning.pipeline.layout import PipelineLayout
from ds_lightning.pipeline.partition import partition_by_cost, resolve_balance
from ds_lightning.pipeline.runtime import TiedWeight

__all__ = [
    "GraphSplit",
    "TracingRefused",
    "auto_split_points",
    "check_split_points",
    "trace_split",
]


_PATCHED = ("forward", "_orig_forward")  # what torch's annotate_split_points sets on each cut submodule


class TracingRefused(ValueError):
    """The module could not be traced or split; the message names the submodule, the construct and the fix."""


def check_split_points(value: object) -> list[str] | Literal["auto"] | None:
    """Validate ``PipelineStrategy(split_points=...)`` at construction.

    Raises:
        ValueError: naming the value and the accepted forms.

    """
    if value is None or value == "auto":
        return value
    if (
        isinstance(value, (list, tuple))
        and value
        and all(
            isinstance(v, str) and v and all(part.isidentifier() or part.isdigit() for part in v.split("."))
            for v in value
        )
    ):
        if len(set(value)) != len(value):
            raise ValueError(f"split_points={list(value)!r} names a submodule twice; name each cut once.")
        return list(value)
    raise ValueError(
        f"split_points={value!r} must be 'auto' or a non-empty list of submodule names to cut before, e.g. "
        "split_points=['blocks.2'] for 2 stages or ['blocks.1', 'blocks.2', 'blocks.3'] for 4."
    )


def _largest_module_list(module: nn.Module) -> tuple[str, nn.ModuleList]:
    lists = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        raise TracingRefused(
            f"split_points='auto' cuts the children of the largest nn.ModuleList, but {type(module).__name__} has "
            "none with 2 or more children; name the cuts, e.g. split_points=['encoder', 'decoder']."
        )
    return max(lists, key=lambda item: (len(item[1]), sum(p.numel() for p in item[1].parameters())))


@contextmanager
def _timed_children(children: Sequence[nn.Module], seconds: list[list[float]]) -> Iterator[None]:
    """Record each child's forward time (``time.perf_counter`` between its pre- and post-hook)."""
    starts: dict[int, float] = {}
    handles = []
    for index, child in enumerate(children):

        def before(_module: nn.Module, _args: Any, index: int = index) -> None:
            starts[index] = time.perf_counter()

        def after(_module: nn.Module, _args: Any, _out: Any, index: int = index) -> None:
            seconds[index].append(time.perf_counter() - starts[index])

        handles += [child.register_forward_pre_hook(before), child.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def auto_split_points(
    module: nn.Module,
    stages: int,
    balance: Sequence[int] | Literal["auto"] | None,
    sample: Callable[[], Any] | None = None,
    agree: Callable[[list[float]], list[float]] | None = None,
) -> tuple[list[str], list[int]]:
    """``split_points='auto'``: cut the children of the module's largest ``nn.ModuleList``.

    Args:
        module: the module to pipeline.
        stages: stages to cut it into.
        balance: children per stage; ``None`` for equal counts; ``"auto"`` to time each child's forward on ``sample``
            and minimise the slowest stage.
        sample: runs the module's forward once on a sample input (for ``balance="auto"``).
        agree: turns this process's per-child seconds into the ones every process uses, so every rank cuts alike.

    Returns:
        The submodule names to cut before, and the children per stage.

    """
    name, children = _largest_module_list(module)
    if balance == "auto":
        resolve_balance(len(children), stages, None)
        assert sample is not None
        seconds: list[list[float]] = [[] for _ in children]
        with torch.no_grad(), _timed_children(list(children), seconds):
            for _ in range(4):  # the first pass warms up and is not counted
                sample()
        costs = [statistics.median(s[1:]) if len(s) > 1 else 0.0 for s in seconds]
        if agree is not None:
            costs = agree(costs)
        counts = partition_by_cost(costs, stages)
    else:
        counts = resolve_balance(len(children), stages, balance)
    cuts, start = [], 0
    for count in counts[:-1]:
        start += count
        cuts.append(f"{name}.{start}")
    return cuts, counts


def _check_names(module: nn.Module, names: Sequence[str]) -> None:
    known = dict(module.named_modules())
    for name in names:
        if name not in known:
            near = [n for n in known if n and n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
            hint = f" Submodules with that last name: {near}." if near else ""
            raise TracingRefused(
                f"split_points names '{name}', which is not a submodule of {type(module).__name__}.{hint} Use "
                "names from `model.named_modules()`, e.g. 'blocks.2' for the third block of `self.blocks`."
            )


def _failing_submodule(module: nn.Module, err: BaseException) -> str:
    """The innermost submodule of ``module`` whose forward was on the stack when tracing failed."""
    names = {id(m): name or "<root>" for name, m in module.named_modules()}
    found = "<root>"
    seen: set[int] = set()
    chain: BaseException | None = err
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        for frame, _ in traceback.walk_tb(chain.__traceback__):
            owner = frame.f_locals.get("self")
            if id(owner) in names:
                found = names[id(owner)]
        chain = chain.__cause__ or chain.__context__
    return found


def _refusal(module: nn.Module, where: str, err: Exception) -> TracingRefused:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return TracingRefused(
        f"ds_pipeline could not trace {type(module).__name__} to split it: in submodule '{where}' "
        f"{type(err).__name__}: {first[:400]}. torch.export traces forward once with the sample micro-batch's shapes; "
        "it stops at Python control flow on tensor values (`if x.sum() > 0`, `.item()`, `.tolist()`), at objects "
        "that are not tensors or pytrees (a key-value cache: pass use_cache=False), and at data-dependent shapes. "
        "Rewrite that construct with torch ops (torch.where, masks), or make the model an nn.Sequential of "
        "one-tensor layers and leave split_points unset."
    )


@dataclass
class GraphSplit:
    """What one process keeps of a traced split.

    Attributes:
        stage_modules: this process's stage ``GraphModule``s by stage index.
        pipe_info: torch's description of the stage graph, which ``_PipelineStage`` reads.
        n_stages: stages in the whole pipeline.
        local_parameters: this process's parameters (and buffers) under their names in the unsplit module; a weight
            that two stages use appears under the name its stage uses.
        tied: for each weight used on several stages, the stage index -> the name that stage uses for it.
        stage_trains: for every stage, whether it has a trainable parameter.
        microbatch_rows: rows of the micro-batch it was traced with (the shapes stay fixed).

    """

    stage_modules: dict[int, nn.Module]
    pipe_info: Any
    n_stages: int
    local_parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    tied: list[dict[int, str]] = field(default_factory=list)
    stage_trains: list[bool] = field(default_factory=list)
    microbatch_rows: int = 0

    def tied_weights(self, module: nn.Module) -> list[TiedWeight]:
        """Each tied weight's shape, with this process's copy when one of its stages is here."""
        weights = []
        for group in self.tied:
            whole = module.get_parameter(next(iter(group.values())))
            copies: dict[int, nn.Parameter] = {}
            for s, name in sorted(group.items()):
                tensor = self.local_parameters.get(name)
                if s in self.stage_modules and isinstance(tensor, nn.Parameter):
                    copies.setdefault(id(tensor), tensor)
            ordered = list(copies.values())
            first_here = min(group) in self.stage_modules
            weights.append(TiedWeight(whole.shape, whole.dtype, ordered, ordered[1:] if first_here else ordered))
        return weights

    def check_every_rank_trains(self, layout: PipelineLayout, style: str) -> None:
        """Refuse a cut that leaves a process without a trainable parameter (its optimizer would be empty).

        Decided from the whole split on every rank, so all raise together instead of some waiting in a collective.

        Raises:
            ValueError: naming the process, its stages and the fix.

        """
        for rank in range(layout.pipeline_size):
            stages = layout.stage_indices(rank, style)
            if not any(self.stage_trains[s] for s in stages):
                raise ValueError(
                    f"Pipeline process {rank} would hold only stages {stages}, which have no trainable parameters, so "
                    "its optimizer would be empty. Move the split points so every stage holds a layer with weights."
                )


def _stage_index(submod_name: str) -> int:
    return int(submod_name.rsplit("_", 1)[-1])


def trace_split(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    split_points: Sequence[str],
    stage_ids: Sequence[int],
) -> GraphSplit:
    """Trace ``module`` on one micro-batch and keep the stages ``stage_ids`` of the cut before each split point.

    The module is traced where it lies, so operations that make tensors (``torch.arange``) are recorded on that device.

    Raises:
        TracingRefused: when a name is not a submodule, or tracing or splitting fails (naming the submodule and why).

    """
    _check_names(module, split_points)
    spec = dict.fromkeys(split_points, SplitPoint.BEGINNING)
    cut = [module.get_submodule(name) for name in split_points]
    before = [{k: sub.__dict__[k] for k in _PATCHED if k in sub.__dict__} for sub in cut]
    try:
        pipe = pipeline(module, mb_args=args, mb_kwargs=dict(kwargs) or None, split_spec=spec)
    except Exception as err:  # torch.export raises many types; each becomes one refusal that says what to do
        raise _refusal(module, _failing_submodule(module, err), err) from err
    finally:
        # torch marks each cut by replacing the submodule's forward in place; undo it, or the module could not be
        # traced again (a second Trainer run) and its own forward would keep the marker.
        for sub, saved in zip(cut, before, strict=True):
            for key in _PATCHED:
                sub.__dict__.pop(key, None)
            sub.__dict__.update(saved)
    expected = len(split_points) + 1
    if pipe.num_stages != expected:
        raise TracingRefused(
            f"split_points={list(split_points)} should cut {type(module).__name__} into {expected} stages, but the "
            f"traced graph has {pipe.num_stages}: a split point whose submodule runs more than once, or not at all, "
            "in forward does not cut. Name submodules that forward calls exactly once, in order."
        )
    tied = [{_stage_index(s): name for s, name in group.items()} for group in pipe.replicated_params]
    trains = [any(p.requires_grad for p in pipe.get_stage_module(i).parameters()) for i in range(pipe.num_stages)]
    rows = next(t.shape[0] for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))
    split = GraphSplit({}, pipe.info(), pipe.num_stages, tied=tied, stage_trains=trains, microbatch_rows=rows)
    for s in stage_ids:
        stage = pipe.get_stage_module(s)
        split.stage_modules[s] = stage
        # A stage may also hold an unused alias of a weight that another stage uses under another name (torch moves
        # every attribute sharing the tied tensor); only the name the stage's graph uses belongs to it.
        aliases = {name for group in tied for stage_id, name in group.items() if stage_id != s}
        for name, tensor in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers()]:
            own = any(group.get(s) == name for group in tied)
            if name in aliases and not own:
                continue
            split.local_parameters[name] = tensor
    return split


def canonical_names(module: nn.Module) -> dict[str, str]:
    """Every parameter name of ``module``, mapped to the first name of the same tensor (tied weights share one)."""
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(param), name)
    return names
