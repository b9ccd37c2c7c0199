"""``DistributedReport``: where each rank's step time went, who the straggler is, and whether it is compute-bound."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from ds_lightning import _validation as check
from ds_lightning.callbacks._step_clock import ClockedCallback
from ds_lightning.diagnostics.payload_bytes import PayloadCounter
from ds_lightning.diagnostics.report import (
    RankSummary,
    Verdict,
    format_table,
    phase_spans,
    render_steps_png,
    report_dict,
    transfer_ms,
    verdict,
)
from ds_lightning.diagnostics.step_times import PHASES, StepTime, step_clock
from ds_lightning.pipeline.trace import write_chrome_trace
from ds_lightning.strategies.capabilities import capabilities_of

__all__ = ["DistributedReport"]

_FIELDS = 6  # step, start_ns and the four phases


class DistributedReport(ClockedCallback):
    """Measure each rank's step time by phase and its collective payload; at the end of ``fit`` name the straggler.

    Every step, on every rank, it times data loading, compute (forward and backward), the wait on communication (from
    the last gradient being ready to the end of the backward pass, where DDP waits for its all-reduces) and the
    optimizer step (:mod:`ds_lightning.diagnostics.step_times`), and counts the payload bytes this rank handed to
    and got back from collectives, read from torch's Flight Recorder (:mod:`ds_lightning.diagnostics.payload_bytes`).
    Every ``every_n_steps`` steps it logs each rank's median phase times of the last window
    (``report/{phase}_ms_rank{r}``). At the end of ``fit`` the ranks gather their figures, and rank 0 prints a table
    with the verdict (:func:`~ds_lightning.diagnostics.report.verdict`), and writes ``report.json`` and
    ``report.png`` (per-rank step time over steps) into ``output_dir``, and, with ``trace_path``, a Chrome/Perfetto
    trace with one track per rank.

    Under a strategy whose ranks do not step together (``ds_parameter_server``'s workers) nothing is gathered: each
    worker writes ``report_rank{r}.json`` and rank 0 prints its own figures.

    Args:
        every_n_steps: steps between logged windows of per-rank figures; 0 logs none (the report at the end stays).
        trace_path: where to write the Chrome/Perfetto trace (``.json``); ``None`` writes none.
        output_dir: folder for ``report.json`` and ``report.png``; ``None`` uses
            ``<default_root_dir>/distributed_report``.
        warmup_steps: first steps left out of the figures (DDP builds its buckets, caches warm up).
        tolerance: share of the median step under which differences between ranks count as noise, in ``(0, 1)``.
        gather_timeout: seconds the gathering collectives may wait for the other ranks.

    Raises:
        ValueError: for an out-of-range option, naming the value and the fix.

    """

    def __init__(
        self,
        every_n_steps: int = 50,
        trace_path: str | None = None,
        output_dir: str | None = None,
        warmup_steps: int = 2,
        tolerance: float = 0.1,
        gather_timeout: float = 300.0,
    ) -> None:
        check.integer("every_n_steps", every_n_steps, 0, "DistributedReport(every_n_steps=50)", "0 logs no windows")
        if trace_path is not None and (not isinstance(trace_path, str) or not trace_path.strip()):
            raise ValueError(
                f"trace_path={trace_path!r} must be a file path, e.g. DistributedReport(trace_path='trace.json')."
            )
        if output_dir is not None and (not isinstance(output_dir, str) or not output_dir.strip()):
            raise ValueError(
                f"output_dir={output_dir!r} must be a folder, e.g. DistributedReport(output_dir='report')."
            )
        check.integer("warmup_steps", warmup_steps, 0, "DistributedReport(warmup_steps=2)")
        check.number("tolerance", tolerance, "DistributedReport(tolerance=0.1)", above=0, below=1)
        check.number("gather_timeout", gather_timeout, "DistributedReport(gather_timeout=300)", above=0)
        self.every_n_steps = every_n_steps
        self.trace_path = trace_path
        self.output_dir = output_dir
        self.warmup_steps = warmup_steps
        self.tolerance = float(tolerance)
        self.gather_timeout = float(gather_timeout)
        self.summaries: list[RankSummary] = []
        self.verdict: Verdict | None = None
        self.table = ""
        self._payload = PayloadCounter()
        self._together = True
        self._since_poll = 0
        self._window: list[StepTime] = []

    # --- measuring ------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._together = capabilities_of(trainer.strategy).agrees_over_default_group
            self.summaries, self.verdict, self.table, self._window = [], None, "", []
            step_clock(trainer).reset()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watch_gradients(trainer, pl_module)
        self._payload.start()
        self._since_poll = 0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        clock = step_clock(trainer)
        clock.batch_end()
        self._since_poll += 1
        if self._payload.due(self._since_poll):
            self._payload.poll(self._since_poll)
            self._since_poll = 0
        last = clock.last
        if last is None or last.step < self.warmup_steps:
            return
        self._window.append(last)
        if self.every_n_steps and len(self._window) >= self.every_n_steps:
            self._log_window(trainer, pl_module)

    def _log_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = RankSummary.of(trainer.global_rank, self._window)
        self._window = []
        figures = torch.tensor([[mine.phase_ms(p) for p in PHASES]], dtype=torch.float64)
        ranks = [trainer.global_rank]
        if self._together and trainer.world_size > 1:
            figures = self._gather(figures, trainer)
            ranks = list(range(trainer.world_size))
        logged = {
            f"report/{phase}_ms_rank{rank}": float(figures[i, j])
            for i, rank in enumerate(ranks)
            for j, phase in enumerate(PHASES)
        }
        pl_module.log_dict(logged, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)

    # --- the report -----------------------------------------------------------------------------------------------

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        clock = step_clock(trainer)
        clock.unwatch()
        self._payload.poll(self._since_poll)
        steps = [s for s in clock.steps if s.step >= self.warmup_steps]
        payload = self._payload
        counts = [
            payload.sent,
            payload.received,
            sum(payload.collectives.values()),
            payload.lost,
            int(payload.available),
        ]
        rank = trainer.global_rank
        if self._together and trainer.world_size > 1:
            by_rank, figures = self._gather_steps(steps, counts, trainer)
        else:
            by_rank, figures = {rank: steps}, {rank: counts}
        self.summaries = [
            RankSummary.of(
                r,
                by_rank[r],
                payload_sent=figures[r][0] if figures[r][4] else None,
                payload_received=figures[r][1] if figures[r][4] else None,
                collectives=figures[r][2],
                lost_records=figures[r][3],
            )
            for r in sorted(by_rank)
        ]
        transfer = transfer_ms(by_rank)
        self.verdict = verdict(self.summaries, self.tolerance, transfer)
        self.table = format_table(self.summaries, self.verdict, self.warmup_steps, transfer)
        alone = not (self._together and trainer.world_size > 1)
        if rank != 0 and not alone:
            return
        folder = Path(self.output_dir) if self.output_dir else Path(trainer.default_root_dir) / "distributed_report"
        name = f"report_rank{rank}" if alone and trainer.world_size > 1 else "report"
        strategy = getattr(trainer.strategy, "strategy_name", None) or type(trainer.strategy).__name__
        meta = {"strategy": strategy, "world_size": trainer.world_size, "warmup_steps": self.warmup_steps}
        meta.update(transfer_ms=transfer, tolerance=self.tolerance)
        if alone and trainer.world_size > 1:
            meta["note"] = f"{strategy}'s ranks do not step together: this is rank {rank}'s own report"
        folder.mkdir(parents=True, exist_ok=True)
        document = report_dict(self.summaries, self.verdict, by_rank, meta)
        (folder / f"{name}.json").write_text(json.dumps(document, indent=1))
        if any(by_rank.values()):
            render_steps_png(by_rank, folder / f"{name}.png", f"DistributedReport ({strategy}): per-rank time per step")
        if self.trace_path is not None:
            spans = [span for r, rank_steps in sorted(by_rank.items()) for span in phase_spans(r, rank_steps)]
            trace = Path(self.trace_path)
            write_chrome_trace(
                spans, trace.with_name(f"{trace.stem}_rank{rank}{trace.suffix}") if name != "report" else trace
            )
        if rank == 0:
            rank_zero_info(self.table)

    def _gather(self, tensor: torch.Tensor, trainer: pl.Trainer) -> torch.Tensor:
        """All-gather ``tensor`` (same shape on every rank) over the default group, waiting ``gather_timeout``."""
        device = trainer.strategy.root_device
        tensor = tensor.to(device)
        out = [torch.empty_like(tensor) for _ in range(trainer.world_size)]
        work = dist.all_gather(out, tensor, async_op=True)
        assert work is not None
        work.wait(timeout=timedelta(seconds=self.gather_timeout))
        return torch.cat(out).cpu()

    def _gather_steps(
        self, steps: list[StepTime], counts: list[int], trainer: pl.Trainer
    ) -> tuple[dict[int, list[StepTime]], dict[int, list[int]]]:
        lengths = self._gather(torch.tensor([len(steps), *counts], dtype=torch.int64), trainer).reshape(
            trainer.world_size, -1
        )
        longest = int(lengths[:, 0].max())
        rows = torch.zeros(max(longest, 1), _FIELDS, dtype=torch.int64)
        if steps:
            fields = [[s.step, s.start_ns, s.data_ns, s.compute_ns, s.comm_ns, s.optimizer_ns] for s in steps]
            rows[: len(steps)] = torch.tensor(fields, dtype=torch.int64)
        table = self._gather(rows, trainer).reshape(trainer.world_size, max(longest, 1), _FIELDS)
        by_rank = {
            r: [StepTime(*(int(v) for v in row)) for row in table[r, : int(lengths[r, 0])].tolist()]
            for r in range(trainer.world_size)
        }
        figures = {r: [int(v) for v in lengths[r, 1:].tolist()] for r in range(trainer.world_size)}
        return by_rank, figures
