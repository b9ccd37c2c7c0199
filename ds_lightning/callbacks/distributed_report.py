"""``DistributedReport``: where each rank's step time went, who the straggler is, and whether it is compute-bound."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import statistics
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
from ds_lightning.diagnostics.link_counters import LinkCounter
from ds_lightning.diagnostics.link_verdict import LinkFinding, LinkUse, RankLinks, find_slow_link
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

_FIELDS = 7  # step, start_ns, the four phases and the wait before the batch
_ADDRESS = 16  # an address as the 16 bytes of IPv6 (IPv4 mapped), for the tensor gathers
_LINK_TOTALS = 3  # bytes sent, bytes received, busy microseconds


def _address_bytes(address: str | None) -> list[int]:
    if address is None:
        return [0] * _ADDRESS
    parsed = ipaddress.ip_address(address)
    if isinstance(parsed, ipaddress.IPv4Address):
        parsed = ipaddress.IPv6Address(f"::ffff:{parsed}")
    return list(parsed.packed)


def _address_of(values: list[int]) -> str | None:
    if not any(values):
        return None
    parsed = ipaddress.IPv6Address(bytes(values))
    return str(parsed.ipv4_mapped) if parsed.ipv4_mapped is not None else str(parsed)


def _main_ports(trainer: pl.Trainer) -> set[int]:
    """The rendezvous store's port: its connections are not links between ranks."""
    ports = set()
    environment = getattr(trainer.strategy, "cluster_environment", None)
    with contextlib.suppress(Exception):
        ports.add(int(environment.main_port))  # type: ignore[union-attr]
    with contextlib.suppress(KeyError, ValueError):
        ports.add(int(os.environ["MASTER_PORT"]))
    return ports


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
        self.links: LinkFinding | None = None
        self._payload = PayloadCounter()
        self._links = LinkCounter()
        self._together = True
        self._since_poll = 0
        self._window: list[StepTime] = []

    # --- measuring ------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._together = capabilities_of(trainer.strategy).agrees_over_default_group
            self.summaries, self.verdict, self.table, self._window = [], None, "", []
            self.links = None
            step_clock(trainer).reset()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watch_gradients(trainer, pl_module)
        self._payload.start()
        self._links = LinkCounter(_main_ports(trainer))
        self._links.start()
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
        measured = last is not None and last.step >= self.warmup_steps
        self._links.sample(last.step if measured and last is not None else None)
        if last is None or not measured:
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
        self._links.sample(None)
        rank = trainer.global_rank
        mine = self._rank_links(rank)
        if self._together and trainer.world_size > 1:
            by_rank, figures = self._gather_steps(steps, counts, trainer)
            links = self._gather_links(mine, by_rank, trainer)
        else:
            by_rank, figures, links = {rank: steps}, {rank: counts}, {rank: mine}
        self._links.stop()
        self.summaries = [
            RankSummary.of(
                r,
                by_rank[r],
                payload_sent=figures[r][0] if figures[r][4] else None,
                payload_received=figures[r][1] if figures[r][4] else None,
                collectives=figures[r][2],
                lost_records=figures[r][3],
                wire_sent=sum(u.bytes_sent for u in links[r].links.values()) if links[r].host else None,
                wire_received=sum(u.bytes_received for u in links[r].links.values()) if links[r].host else None,
            )
            for r in sorted(by_rank)
        ]
        transfer = transfer_ms(by_rank)
        self.verdict = verdict(self.summaries, self.tolerance, transfer)
        step_ms = statistics.median(s.step_ms for s in self.summaries) if self.summaries else 0.0
        self.links = find_slow_link([links[r] for r in sorted(links)], step_ms)
        self.table = format_table(self.summaries, self.verdict, self.warmup_steps, transfer, self.links)
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
        meta["table"] = self.table
        document = report_dict(self.summaries, self.verdict, by_rank, meta, self.links)
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
            fields = [
                [s.step, s.start_ns, s.data_ns, s.compute_ns, s.comm_ns, s.optimizer_ns, s.sync_ns] for s in steps
            ]
            rows[: len(steps)] = torch.tensor(fields, dtype=torch.int64)
        table = self._gather(rows, trainer).reshape(trainer.world_size, max(longest, 1), _FIELDS)
        by_rank = {
            r: [StepTime(*(int(v) for v in row)) for row in table[r, : int(lengths[r, 0])].tolist()]
            for r in range(trainer.world_size)
        }
        figures = {r: [int(v) for v in lengths[r, 1:].tolist()] for r in range(trainer.world_size)}
        return by_rank, figures

    def _rank_links(self, rank: int) -> RankLinks:
        counter = self._links
        if not counter.available:
            return RankLinks(rank, None, {})
        uses = {
            remote: LinkUse(link.bytes_sent, link.bytes_received, link.busy_us, dict(link.step_busy_us))
            for remote, link in counter.links.items()
        }
        return RankLinks(rank, counter.host_address(), uses)

    def _gather_links(
        self, mine: RankLinks, by_rank: dict[int, list[StepTime]], trainer: pl.Trainer
    ) -> dict[int, RankLinks]:
        """Every rank's :class:`RankLinks`, in two gathers.

        First a header (remote count, host address), then one row per remote address: its address, the totals, and
        the busy time at each of the rank's measured steps, in their order.
        """
        header = torch.tensor([len(mine.links), *_address_bytes(mine.host)], dtype=torch.int64)
        headers = self._gather(header, trainer).reshape(trainer.world_size, -1)
        widest = max(int(headers[:, 0].max()), 1)
        longest = max((len(steps) for steps in by_rank.values()), default=0)
        rows = torch.zeros(widest, _ADDRESS + _LINK_TOTALS + longest, dtype=torch.int64)
        order = [s.step for s in by_rank[trainer.global_rank]]
        for i, (remote, use) in enumerate(sorted(mine.links.items())):
            per_step = [use.step_busy_us.get(step, 0) for step in order]
            values = [*_address_bytes(remote), use.bytes_sent, use.bytes_received, use.busy_us, *per_step]
            rows[i, : len(values)] = torch.tensor(values, dtype=torch.int64)
        table = self._gather(rows, trainer).reshape(trainer.world_size, widest, -1)
        found = {}
        for r in range(trainer.world_size):
            steps = [s.step for s in by_rank[r]]
            uses = {}
            for row in table[r, : int(headers[r, 0])].tolist():
                sent, received, busy = row[_ADDRESS : _ADDRESS + _LINK_TOTALS]
                step_busy = dict(zip(steps, row[_ADDRESS + _LINK_TOTALS :], strict=False))
                uses[str(_address_of(row[:_ADDRESS]))] = LinkUse(sent, received, busy, step_busy)
            found[r] = RankLinks(r, _address_of(headers[r, 1:].tolist()), uses)
        return found
