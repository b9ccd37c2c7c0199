"""One launch of the pipeline benchmark: every configuration of one (implementation, p) pair (README.md). Each rank
appends a JSON line per finished configuration to ``<out_dir>/rank<r>.jsonl``: a crash loses only the one it was in."""

from __future__ import annotations

import copy
import functools
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WIDTH, DEPTH, SAMPLES, LR = 512, 8, 1024, 0.01
GPT_LR, DISTINCT_BATCHES = 3e-4, 8


class _Saved:
    """What autograd stores instead of a saved tensor; releasing it gives the bytes back to the meter."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], meter: ActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


class ActivationMeter:
    """Live and peak bytes autograd saves for backward inside :class:`Counted` blocks; parameters are skipped, and a
    tensor saved twice (a ReLU's output is also the next Linear's input) counts once while any save is alive."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._refs: dict[tuple[int, int], int] = {}

    def pack(self, skip: frozenset[int], tensor: torch.Tensor) -> Any:
        if tensor.data_ptr() in skip:
            return tensor
        key = (tensor.data_ptr(), tensor.nbytes)
        if not self._refs.get(key):
            self.live += tensor.nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        # Detached: a saved output holding its own grad_fn would be a reference cycle, freed only by the gc.
        return _Saved(tensor.detach(), key, self)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: tuple[int, int]) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= key[1]

    def reset_peak(self) -> None:
        self.peak = self.live


METER = ActivationMeter()


class Counted(nn.Module):
    """One block with its saved-for-backward tensors counted by :data:`METER` (in every implementation alike)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = frozenset(p.data_ptr() for p in self.block.parameters())
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(METER.pack, skip), METER.unpack):
            return self.block(x)


def is_gpt(spec: dict[str, Any]) -> bool:
    return spec.get("workload", {}).get("model") == "gpt"


@functools.cache
def _gpt(workload: str, seed: int) -> Any:
    from benchmarks.harness import workloads  # here: the digits model runs without importing Lightning

    return workloads.build(json.loads(workload), seed=seed)


def gpt_workload(spec: dict[str, Any]) -> Any:
    """The GPT and its text, built once per process: every configuration copies the same weights."""
    return _gpt(json.dumps(spec["workload"], sort_keys=True), spec["seed"])


def make_net(spec: dict[str, Any]) -> nn.Sequential:
    if is_gpt(spec):
        return nn.Sequential(*(Counted(layer) for layer in copy.deepcopy(gpt_workload(spec).net)))
    torch.manual_seed(spec["seed"])
    return nn.Sequential(*(Counted(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())) for _ in range(DEPTH)))


def make_data(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of every distinct batch, in order (steps cycle through them)."""
    if is_gpt(spec):
        pairs = [gpt_workload(spec).train_set[i] for i in range(DISTINCT_BATCHES * spec["batch"])]
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    return torch.randn(SAMPLES, WIDTH, generator=g), torch.randn(SAMPLES, WIDTH, generator=g)


def batches(spec: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = make_data(spec)
    return list(zip(x.split(spec["batch"]), y.split(spec["batch"]), strict=True))


def loss_fn(spec: dict[str, Any]) -> Any:
    return gpt_workload(spec).loss if is_gpt(spec) else F.mse_loss


def make_optimizer(spec: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=GPT_LR) if is_gpt(spec) else torch.optim.SGD(params, lr=LR)


def stage_balance(spec: dict[str, Any], stages: int) -> list[int]:
    """Layers per stage: blocks split equally; the GPT's embedding joins the first stage, its norm and head the last."""
    if not is_gpt(spec):
        return [DEPTH // stages] * stages
    per = (len(gpt_workload(spec).net) - 3) // stages  # the net: embedding, blocks, final norm, head
    return [per + 3] if stages == 1 else [per + 1] + [per] * (stages - 2) + [per + 2]


def stage_blocks(net: nn.Sequential, stage: int, stages: int, spec: dict[str, Any]) -> nn.Sequential:
    balance = stage_balance(spec, stages)
    first = sum(balance[:stage])
    return nn.Sequential(*net[first : first + balance[stage]])


def sample_input(spec: dict[str, Any], stage: int, rows: int) -> torch.Tensor:
    """One micro-batch's input to ``stage``: token ids for the GPT's first stage, float activations after it."""
    if not is_gpt(spec):
        return torch.randn(rows, WIDTH, requires_grad=stage > 0)
    shape = spec["workload"]  # the driver's spec names every dimension
    if stage == 0:
        return torch.randint(0, 256, (rows, shape["block_size"]))
    return torch.randn(rows, shape["block_size"], shape["d_model"], requires_grad=True)


def unit_bytes(spec: dict[str, Any], stage: int, stages: int, m: int) -> int:
    """Activation bytes one micro-batch (batch / m rows) leaves saved in one stage's blocks."""
    base = METER.live
    METER.reset_peak()
    out = stage_blocks(make_net(spec), stage, stages, spec)(sample_input(spec, stage, spec["batch"] // m))
    measured = METER.peak - base
    del out
    METER.reset_peak()
    return measured


def record(spec: dict[str, Any], rank: int, cfg: dict[str, Any], ms: list[float], **extra: Any) -> None:
    """One rank's line for one configuration: step times, its activation peak and one micro-batch's, and CPU time per
    step (every thread, gloo's too: with more processes than cores, the ranks' sum bounds the step from below)."""
    peak = METER.peak  # before unit_bytes, which measures a micro-batch with the same meter
    line = {"key": cfg["key"], "rank": rank, "step_ms": ms, "median_step_ms": statistics.median(ms) if ms else None}
    line.update(peak_bytes={str(rank): peak}, unit_bytes={str(rank): unit_bytes(spec, rank, spec["procs"], cfg["m"])})
    with (Path(spec["out_dir"]) / f"rank{rank}.jsonl").open("a") as f:
        f.write(json.dumps({**line, **extra}) + "\n")


def train(spec: dict[str, Any], data: list[Any], cfg: dict[str, Any], rank: int, net: nn.Module, run: Any,
          trace: Any = None) -> None:  # fmt: skip
    """Warm-up, then the timed steps of ``run(x, y)`` and the optimizer; one line with the times and the CPU ms per
    timed step (the activation peak counts from the first timed step)."""
    optimizer, times = make_optimizer(spec, net.parameters()), []
    for i in range(spec["warmup"] + spec["steps"]):
        if trace:
            trace.begin_step(i)
        if i == spec["warmup"]:
            METER.reset_peak()
            cpu = time.process_time()
        start = time.perf_counter()
        run(*data[i % len(data)])
        optimizer.step()
        optimizer.zero_grad()
        if i >= spec["warmup"]:
            times.append(1000 * (time.perf_counter() - start))
    cpu_ms = 1000 * (time.process_time() - cpu) / spec["steps"]
    record(spec, rank, cfg, times, cpu_ms=cpu_ms, **({"spans": trace.to_payload()} if trace else {}))


def run_single(spec: dict[str, Any]) -> None:
    data, loss = batches(spec), loss_fn(spec)
    for cfg in spec["configs"]:
        net, m = make_net(spec), cfg["m"]

        def run(x: torch.Tensor, y: torch.Tensor, net: nn.Module = net, m: int = m) -> None:
            for xc, yc in zip(x.chunk(m), y.chunk(m), strict=True):  # m sequential chunks: no pipeline
                (loss(net(xc), yc) / m).backward()

        train(spec, data, cfg, 0, net, run)


def _hand_rank(rank: int, spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from ds_lightning.pipeline.stage import TracedStage
    from ds_lightning.pipeline.trace import SpanRecorder

    torch.set_num_threads(1)
    p = spec["procs"]
    dist.init_process_group("gloo", rank=rank, world_size=p, timeout=timedelta(seconds=spec["dist_timeout"]))
    data, loss = batches(spec), loss_fn(spec)
    for cfg in spec["configs"]:
        dist.barrier()
        blocks = stage_blocks(make_net(spec), rank, p, spec)
        recorder = SpanRecorder(rank, steps=spec["trace_steps"], skip_steps=1)
        stage = TracedStage(blocks, rank, p, torch.device("cpu"), recorder=recorder)
        kind = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[cfg["schedule"]]
        schedule = kind(stage, n_microbatches=cfg["m"], loss_fn=loss, scale_grads=True)

        def run(x: torch.Tensor, y: torch.Tensor, schedule: Any = schedule) -> None:
            schedule.step(*([x] if rank == 0 else []), **({"target": y} if rank == p - 1 else {}))

        train(spec, data, cfg, rank, blocks, run, recorder)
    leave(spec, rank, p)


def run_hand(spec: dict[str, Any]) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_hand_rank, args=(spec,), nprocs=spec["procs"], join=True)


def _spans_from_chrome(path: Path) -> list[list[Any]]:
    """Span payload tuples back from the strategy's Chrome trace (times relative to the first span)."""
    spans = []
    for e in (e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"):
        a, start = e["args"], round(e["ts"] * 1000)
        spans.append(
            [e["pid"], a["stage"], a["kind"], a["microbatch"], a["step"], start, start + round(e["dur"] * 1000)]
        )
    return spans


def _timer(spec: dict[str, Any]) -> Any:
    """The harness's step clock; the activation peak and CPU clock start with the first timed step (Lightning's work
    between steps is inside the CPU time)."""
    from benchmarks.harness.timing import StepTimer

    class Timer(StepTimer):
        cpu = 0.0
        cpu_ms: float | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if len(self.step_ms) == self.warmup:
                METER.reset_peak()
                self.cpu = time.process_time()
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if len(self.step_ms) == self.warmup + spec["steps"]:
                self.cpu_ms = 1000 * (time.process_time() - self.cpu) / spec["steps"]

    return Timer(spec["warmup"])


def _fit_timed(spec: dict[str, Any], module: Any, strategy: Any, **trainer_kwargs: Any) -> tuple[Any, Any]:
    """Fit ``module`` for warm-up + timed steps on p processes; the trainer and its timer.

    The hand-written loop indexes ready-made batches; the Trainer gets the same ones (batch_size=None: no per-sample
    fetch and collation, which would cost every rank CPU the hand-written loop never spends, taken from the stages
    when there are more processes than cores).
    """
    from torch.utils.data import DataLoader

    from benchmarks.harness.trainer import quiet_trainer

    timer, steps = _timer(spec), spec["warmup"] + spec["steps"]
    trainer = quiet_trainer(
        accelerator="cpu", devices=spec["procs"], strategy=strategy, max_steps=steps, callbacks=[timer],
        **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, DataLoader(cast(Any, batches(spec)), batch_size=None))  # a list of batches serves as a dataset
    return trainer, timer


def run_ds(spec: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    import ds_lightning

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(spec)

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss(output, target)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.pipeline_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(spec, self.parameters())

    p, loss, rank = spec["procs"], loss_fn(spec), 0
    for cfg in spec["configs"]:
        trace = Path(spec["out_dir"]) / "ds_traces" / f"{cfg['schedule']}_m{cfg['m']}.json"
        strategy = ds_lightning.PipelineStrategy(
            schedule=cfg["schedule"], n_microbatches=cfg["m"], balance=stage_balance(spec, p), trace_path=str(trace),
            trace_steps=spec["trace_steps"], timeout=float(spec["dist_timeout"]),
        )  # fmt: skip
        trainer, timer = _fit_timed(spec, BenchModule(), strategy)
        rank = trainer.global_rank
        spans = _spans_from_chrome(trace) if rank == 0 and trace.exists() else []
        record(spec, rank, cfg, timer.step_ms[spec["warmup"] :], spans=spans, cpu_ms=timer.cpu_ms)
    leave(spec, rank, p)


def run_lightning(spec: dict[str, Any]) -> None:
    """The hand-written loop's stage and schedule, called from ``training_step`` of a Lightning Trainer: what
    Lightning's own loop costs around a pipeline, with nothing of ds_pipeline. Manual optimization (the schedule runs
    the backward), so Lightning's automatic-optimization closure, which ds_pipeline pays, is not counted here."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from ds_lightning.pipeline.stage import TracedStage

    class Unwrapped(DDPStrategy):
        """Lightning's launch, process group and loop; the module is not wrapped in DDP (every rank holds another
        stage, which DDP would overwrite with rank 0's)."""

        def configure_ddp(self) -> None:
            pass

    class HandModule(pl.LightningModule):
        def __init__(self, cfg: dict[str, Any]) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.cfg = cfg

        def configure_model(self) -> None:
            if not hasattr(self, "blocks"):
                self.blocks = stage_blocks(make_net(spec), self.global_rank, p, spec)

        def on_fit_start(self) -> None:
            stage = TracedStage(self.blocks, self.global_rank, p, torch.device("cpu"))
            kind = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[self.cfg["schedule"]]
            self.schedule = kind(stage, n_microbatches=self.cfg["m"], loss_fn=loss, scale_grads=True)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            rank, losses = self.global_rank, cast(list[torch.Tensor], [])
            last = {"target": y, "losses": losses} if rank == p - 1 else {}
            self.schedule.step(*([x] if rank == 0 else []), **last)
            optimizer = cast(Any, self.optimizers())  # the one optimizer configure_optimizers returns
            optimizer.step()
            optimizer.zero_grad()
            # The step's loss where it is known (the last stage); the harness's clock reads one from every rank.
            return torch.stack(losses).mean() if losses else torch.full((), float("nan"))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(spec, self.parameters())

    p, loss, rank = spec["procs"], loss_fn(spec), 0
    for cfg in spec["configs"]:
        strategy = Unwrapped(process_group_backend="gloo", timeout=timedelta(seconds=spec["dist_timeout"]))
        trainer, timer = _fit_timed(spec, HandModule(cfg), strategy, use_distributed_sampler=False)
        rank = trainer.global_rank
        record(spec, rank, cfg, timer.step_ms[spec["warmup"] :], cpu_ms=timer.cpu_ms)
    leave(spec, rank, p)


def leave(spec: dict[str, Any], rank: int, ranks: int) -> None:
    """Exit at once when every rank has written its lines (rank 0 waits): teardown measures nothing and took seconds.
    Not in the harness: importing ``benchmarks.harness`` loads Lightning, which the hand-written ranks never import."""
    done = Path(spec["out_dir"]) / f"done{rank}"
    done.touch()
    deadline = time.monotonic() + spec["dist_timeout"]
    while (
        rank == 0 and time.monotonic() < deadline and not all(done.with_name(f"done{r}").exists() for r in range(ranks))
    ):
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    {"single": run_single, "hand": run_hand, "lightning": run_lightning, "ds": run_ds}[spec["impl"]](spec)
