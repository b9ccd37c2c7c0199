"""One launch of the pipeline benchmark: every configuration of one (implementation, processes) pair.

Started by ``driver.py`` with a JSON spec; its ``"workload"`` entry picks the model: the default 8 x
(Linear(512, 512) + ReLU) on random data (MSE, SGD), or the byte-level GPT of ``harness/workloads.py`` on text
windows (cross-entropy, AdamW), split into an embedding-led first stage, equal runs of blocks, and a last stage that
ends with the final norm and the head. ``--impl single`` runs one process (forward + backward + step,
optionally over m sequential chunks); ``hand`` spawns p ranks running a hand-written ``torch.distributed.pipelining``
loop; ``ds`` runs one Lightning Trainer with ``ds_pipeline`` per configuration (Lightning's popen launcher re-runs this
script per rank, and the process group stays up between fits). Each rank appends one JSON line per finished
configuration to ``<out_dir>/rank<r>.jsonl``, so a crash or a hang loses only the configuration it happened in.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import workloads as _workloads

WIDTH, DEPTH, BATCH, SAMPLES, LR = 512, 8, 128, 1024, 0.01
GPT_LR, DISTINCT_BATCHES = 3e-4, 8


# --- activation memory ------------------------------------------------------------------------------------------------


class _Saved:
    """What autograd stores instead of a saved tensor; releasing it gives the bytes back to the meter."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], meter: ActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


class ActivationMeter:
    """Live and peak bytes of the tensors autograd saves for backward inside :class:`Counted` blocks.

    Parameters (the weight a Linear saves) are not activations and are skipped. A tensor saved twice (a ReLU's output
    is also the next Linear's input) counts once while any of its saves is alive.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple[int, int], int] = {}

    def pack(self, skip: frozenset[int], tensor: torch.Tensor) -> Any:
        ptr = tensor.data_ptr()
        if ptr in skip:
            return tensor
        key = (ptr, tensor.nbytes)
        count = self._refs.get(key, 0)
        if count == 0:
            self.live += tensor.nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] = count + 1
        # Detached: a saved output holding its own grad_fn would be a reference cycle, freed only by the gc.
        return _Saved(tensor.detach(), key, self)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: tuple[int, int]) -> None:
        count = self._refs[key] - 1
        if count:
            self._refs[key] = count
        else:
            del self._refs[key]
            self.live -= key[1]

    def reset_peak(self) -> None:
        self.peak = self.live


METER = ActivationMeter()


class Counted(nn.Module):
    """Runs one block with its saved-for-backward tensors counted by :data:`METER` (used by every implementation)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = frozenset(p.data_ptr() for p in self.block.parameters())
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(METER.pack, skip), METER.unpack):
            return self.block(x)


def _workload(spec: dict[str, Any]) -> dict[str, Any]:
    return spec.get("workload") or {"model": "digits"}


def is_gpt(spec: dict[str, Any]) -> bool:
    return _workload(spec)["model"] == "gpt"


def batch_rows(spec: dict[str, Any]) -> int:
    """Rows of one step's batch: random vectors for the default model, windows of text for the GPT."""
    return int(spec.get("batch") or BATCH)


@functools.cache
def _gpt(workload: str, seed: int) -> _workloads.Workload:
    return _workloads.build(json.loads(workload), seed=seed)


def gpt_workload(spec: dict[str, Any]) -> _workloads.Workload:
    """The GPT and its text, built once per process (every configuration starts from a copy of the same weights)."""
    return _gpt(json.dumps(_workload(spec), sort_keys=True), spec["seed"])


def make_net(spec: dict[str, Any]) -> nn.Sequential:
    if is_gpt(spec):
        return nn.Sequential(*(Counted(layer) for layer in copy.deepcopy(gpt_workload(spec).net)))
    torch.manual_seed(spec["seed"])
    return nn.Sequential(*(Counted(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())) for _ in range(DEPTH)))


def make_data(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of every distinct batch, in order (steps cycle through them)."""
    if is_gpt(spec):
        windows = gpt_workload(spec).train_set
        pairs = [windows[i] for i in range(DISTINCT_BATCHES * batch_rows(spec))]
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    return torch.randn(SAMPLES, WIDTH, generator=g), torch.randn(SAMPLES, WIDTH, generator=g)


def batches(spec: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = make_data(spec)
    rows = batch_rows(spec)
    return [(x[i : i + rows], y[i : i + rows]) for i in range(0, len(x), rows)]


def loss_fn(spec: dict[str, Any]) -> Any:
    return gpt_workload(spec).loss if is_gpt(spec) else F.mse_loss


def make_optimizer(spec: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=GPT_LR) if is_gpt(spec) else torch.optim.SGD(params, lr=LR)


def stage_balance(spec: dict[str, Any], stages: int) -> list[int]:
    """Layers per stage: equal for the default model; for the GPT, the blocks split equally with the embedding on the
    first stage and the final norm and head on the last (the benchmark refuses a block count p does not divide)."""
    if not is_gpt(spec):
        return [DEPTH // stages] * stages
    per = (len(gpt_workload(spec).net) - 3) // stages  # the net: embedding, blocks, final norm, head
    if stages == 1:
        return [per + 3]
    return [per + 1] + [per] * (stages - 2) + [per + 2]


def stage_blocks(net: nn.Sequential, stage: int, stages: int, spec: dict[str, Any]) -> nn.Sequential:
    balance = stage_balance(spec, stages)
    first = sum(balance[:stage])
    return nn.Sequential(*net[first : first + balance[stage]])


def sample_input(spec: dict[str, Any], stage: int, rows: int) -> torch.Tensor:
    """One micro-batch's input to ``stage``: token ids for the GPT's first stage, float activations after it."""
    if not is_gpt(spec):
        return torch.randn(rows, WIDTH, requires_grad=stage > 0)
    shape = {**_workloads.GPT_DEFAULTS, **_workload(spec)}
    if stage == 0:
        return torch.randint(0, 256, (rows, shape["block_size"]))
    return torch.randn(rows, shape["block_size"], shape["d_model"], requires_grad=True)


def unit_bytes(spec: dict[str, Any], stage: int, stages: int, m: int) -> int:
    """Activation bytes one micro-batch (batch / m rows) leaves saved in one stage's blocks."""
    blocks = stage_blocks(make_net(spec), stage, stages, spec)
    x = sample_input(spec, stage, batch_rows(spec) // m)
    base = METER.live
    METER.reset_peak()
    out = blocks(x)
    measured = METER.peak - base
    del out
    METER.reset_peak()
    return measured


def _cpu_ms_per_step(since: float, steps: int) -> float:
    """This process's CPU time (every thread: gloo's too) per timed step: with more processes than cores, what the
    ranks spend together bounds the step from below."""
    return 1000 * (time.process_time() - since) / steps


def record(spec: dict[str, Any], rank: int, cfg: dict[str, Any], times: list[float], **extra: Any) -> None:
    line = {
        "key": cfg["key"],
        "rank": rank,
        "step_ms": [1000 * t for t in times],
        "median_step_ms": 1000 * statistics.median(times) if times else None,
        **extra,
    }
    path = Path(spec["out_dir"]) / f"rank{rank}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()


def record_stage(
    spec: dict[str, Any], rank: int, cfg: dict[str, Any], times: list[float], spans: list[Any], cpu_ms: float | None
) -> None:
    """One pipeline stage's record: its step times, activation peak against one micro-batch's, spans and CPU time."""
    peak = {str(rank): METER.peak}  # before unit_bytes, which measures a micro-batch with the same meter
    unit = unit_bytes(spec, rank, spec["procs"], cfg["m"])
    record(spec, rank, cfg, times, peak_bytes=peak, unit_bytes={str(rank): unit}, spans=spans, cpu_ms=cpu_ms)


# --- single process ---------------------------------------------------------------------------------------------------


def run_single(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    data, loss = batches(spec), loss_fn(spec)
    for cfg in spec["configs"]:
        m = cfg["m"]
        net = make_net(spec)
        optimizer = make_optimizer(spec, net.parameters())
        times: list[float] = []
        for step in range(spec["warmup"] + spec["steps"]):
            x, y = data[step % len(data)]
            if step == spec["warmup"]:
                METER.reset_peak()
                cpu = time.process_time()
            start = time.perf_counter()
            if m == 1:
                loss(net(x), y).backward()
            else:  # m sequential chunks, gradients accumulated: micro-batching without a pipeline
                for xc, yc in zip(x.chunk(m), y.chunk(m), strict=True):
                    (loss(net(xc), yc) / m).backward()
            optimizer.step()
            optimizer.zero_grad()
            elapsed = time.perf_counter() - start
            if step >= spec["warmup"]:
                times.append(elapsed)
        peak, cpu_ms = METER.peak, _cpu_ms_per_step(cpu, spec["steps"])
        record(spec, 0, cfg, times, peak_bytes={"0": peak}, unit_bytes={"0": unit_bytes(spec, 0, 1, m)}, cpu_ms=cpu_ms)


# --- hand-written torch.distributed.pipelining loop -------------------------------------------------------------------


def _hand_rank(rank: int, spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from ds_lightning.pipeline.stage import TracedStage
    from ds_lightning.pipeline.trace import SpanRecorder

    torch.set_num_threads(1)
    p = spec["procs"]
    dist.init_process_group("gloo", rank=rank, world_size=p, timeout=timedelta(seconds=spec["dist_timeout"]))
    data, loss = batches(spec), loss_fn(spec)
    classes = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
    for cfg in spec["configs"]:
        dist.barrier()
        m = cfg["m"]
        blocks = stage_blocks(make_net(spec), rank, p, spec)
        recorder = SpanRecorder(rank, steps=spec["trace_steps"], skip_steps=1)
        stage = TracedStage(blocks, rank, p, torch.device("cpu"), recorder=recorder)
        schedule = classes[cfg["schedule"]](stage, n_microbatches=m, loss_fn=loss, scale_grads=True)
        optimizer = make_optimizer(spec, blocks.parameters())
        times: list[float] = []
        for step in range(spec["warmup"] + spec["steps"]):
            x, y = data[step % len(data)]
            recorder.begin_step(step)
            if step == spec["warmup"]:
                METER.reset_peak()
                cpu = time.process_time()
            start = time.perf_counter()
            if rank == 0:
                schedule.step(x)
            elif rank == p - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            optimizer.step()
            optimizer.zero_grad()
            elapsed = time.perf_counter() - start
            if step >= spec["warmup"]:
                times.append(elapsed)
        record_stage(spec, rank, cfg, times, recorder.to_payload(), _cpu_ms_per_step(cpu, spec["steps"]))
    dist.barrier()
    dist.destroy_process_group()


def run_hand(spec: dict[str, Any]) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_hand_rank, args=(spec,), nprocs=spec["procs"], join=True)


# --- ds_pipeline under a Lightning Trainer ----------------------------------------------------------------------------


def _spans_from_chrome(path: Path) -> list[list[Any]]:
    """Span payload tuples back from the strategy's Chrome trace (times relative to the first span)."""
    spans = []
    for e in json.loads(path.read_text())["traceEvents"]:
        if e.get("ph") != "X":
            continue
        a = e["args"]
        start = round(e["ts"] * 1000)
        spans.append(
            [e["pid"], a["stage"], a["kind"], a["microbatch"], a["step"], start, start + round(e["dur"] * 1000)]
        )
    return spans


def run_ds(spec: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import ds_lightning
    from benchmarks.harness.timing import StepTimer
    from benchmarks.harness.trainer import quiet_trainer

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(spec)

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss(output, target)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return self.pipeline_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(spec, self.parameters())

    class Timer(StepTimer):
        """The harness's clock; the activation peak restarts with the first timed step."""

        cpu = 0.0
        cpu_ms: float | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if len(self.step_ms) == self.warmup:
                METER.reset_peak()
                self.cpu = time.process_time()
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if len(self.step_ms) == self.warmup + spec["steps"]:  # Lightning's work between steps is inside
                self.cpu_ms = _cpu_ms_per_step(self.cpu, spec["steps"])

    torch.set_num_threads(1)
    p = spec["procs"]
    x, y = make_data(spec)
    loss = loss_fn(spec)
    traces = Path(spec["out_dir"]) / "ds_traces"
    for cfg in spec["configs"]:
        m = cfg["m"]
        trace_path = traces / f"{cfg['schedule']}_m{m}.json"
        timer = Timer(spec["warmup"])
        strategy = ds_lightning.PipelineStrategy(
            schedule=cfg["schedule"],
            n_microbatches=m,
            balance=stage_balance(spec, p),
            trace_path=str(trace_path),
            trace_steps=spec["trace_steps"],
            timeout=float(spec["dist_timeout"]),
        )
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=p,
            strategy=strategy,
            max_steps=spec["warmup"] + spec["steps"],
            default_root_dir=spec["out_dir"],
            callbacks=[timer],
        )
        loader = DataLoader(TensorDataset(x, y), batch_size=batch_rows(spec), shuffle=False, drop_last=True)
        trainer.fit(BenchModule(), train_dataloaders=loader)
        rank = trainer.global_rank
        spans = _spans_from_chrome(trace_path) if rank == 0 and trace_path.exists() else []
        times = [ms / 1000 for ms in timer.step_ms[spec["warmup"] :]]
        record_stage(spec, rank, cfg, times, spans, timer.cpu_ms)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"single": run_single, "hand": run_hand, "ds": run_ds}[spec["impl"]](spec)


if __name__ == "__main__":
    main()
