"""What the memory and sharding-engines benchmarks share (``memory/``, ``sharding_engines/``): their
options and workload defaults, issue 16's targets and verdicts, the MB figures, the summary and pieces of the page.

Both run the same workloads and the same runs (only the engine differs); this module keeps them so.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import Panel, fmt
from benchmarks.harness import workloads as _workloads

#: per-workload defaults of the options left unset: a full run, then --quick
MODEL_DEFAULTS = {
    "digits": ({"steps": 100, "warmup": 10, "batch_size": 32}, {"steps": 5, "warmup": 2}),
    "gpt": ({"steps": 20, "warmup": 3, "batch_size": 8}, {"steps": 3, "warmup": 1}),
}
OPTIMIZERS = {"digits": "Adam (lr 1e-3)", "gpt": "AdamW (lr 3e-4, betas 0.9/0.95, no weight decay)"}
#: the optimizer-state target per world size (issue 16); other sizes are reported without one
STATE_TARGETS = {2: 0.55, 4: 0.30}
STEP_TARGET = 1.10
BYTES_TARGET = 1.1
#: the sharding-engines benchmark's parity target: final parameters equal to DDP's within fp32 tolerance
PARITY_ATOL = 1e-5


def add_options(parser: argparse.ArgumentParser) -> None:
    """Both benchmarks' options (beyond the harness's): process counts, steps, widths, batch, timeout, workload."""
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="process counts (2 4)")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per run (digits 100, GPT 20; --quick: 5, 3)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps left out (digits 10, GPT 3; --quick: 2, 1)"
    )
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024], help="hidden widths (1024 1024)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch per process (digits 32, GPT 8)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (600)")
    _workloads.add_options(parser)


def model_defaults(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill ``--steps``, ``--warmup`` and ``--batch-size`` left unset from the workload's full or quick defaults."""
    return _workloads.fill_defaults(
        opts, {m: d[0] for m, d in MODEL_DEFAULTS.items()}, {m: d[1] for m, d in MODEL_DEFAULTS.items()}
    )


def meta(opts: argparse.Namespace) -> dict[str, Any]:
    """The workload's spec and label for the results (after :func:`model_defaults`)."""
    model_defaults(opts)
    workload = _workloads.spec_of(opts)
    return {"workload": workload, "workload_label": _workloads.label(workload, opts.hidden)}


def workload_label(data: dict[str, Any]) -> str:
    """The page's name for the workload (results from before the GPT: the digits MLP of their widths)."""
    return data.get("workload_label") or _workloads.label({"model": "digits"}, data["settings"].get("hidden"))


def ring_bytes(rank: Mapping[str, Any], world: int) -> float:
    """Bytes a rank sends per step if every collective ran as a ring, its broadcasts counted once from the owner.

    ``rank`` holds its payloads: ``allreduce_bytes``, ``broadcast_bytes``, ``allgather_bytes`` (its shard) and
    ``reducescatter_bytes`` (the whole input). A ring all-reduce of B bytes sends 2(N-1)/N B per rank; a ring
    all-gather of a B/N shard sends (N-1) B/N; a ring reduce-scatter of a B input sends (N-1)/N B. A broadcast's owner
    sends its payload at least once (a lower bound: a one-to-all broadcast sends it N-1 times).
    """
    n = world
    return (
        2 * (n - 1) / n * rank["allreduce_bytes"]
        + rank["broadcast_bytes"]
        + (n - 1) * rank["allgather_bytes"]
        + (n - 1) / n * rank["reducescatter_bytes"]
    )


def verdict(ratio: Mapping[str, Any] | None, limit: float | None) -> str:
    """The harness's verdict on a ratio against its upper ``limit``; ``-`` with no target."""
    return "-" if limit is None else harness.verdict(ratio, at_most=limit)


def judged(arm: Mapping[str, Any], procs: int, checks: Sequence[tuple[str, str, float | None]]) -> list[dict[str, Any]]:
    """Per ``(what, key, limit)`` check: the arm's ``<key>_ratio`` and its verdict."""
    out = []
    for what, key, limit in checks:
        ratio = arm.get(f"{key}_ratio")
        out.append({"what": what, "procs": procs, "ratio": ratio, "limit": limit, "verdict": verdict(ratio, limit)})
    return out


def verdicts(targets: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The targets of :func:`judged` as ``summary["verdicts"]`` lists them; a figure without a limit is left out."""
    return [
        harness.judged(
            f"{t['engine'] + ': ' if 'engine' in t else ''}{t['what']}, {t['procs']} processes",
            t["ratio"],
            at_most=t["limit"],
            unit="x",
        )
        for t in targets
        if t["limit"] is not None
    ]


def with_mb(records: list[dict[str, Any]], mb_keys: Mapping[str, str]) -> list[dict[str, Any]]:
    """The records, their byte figures also in MB (derived here, so ``--render`` needs nothing new in the JSON)."""
    return [
        {**r, **{mb: r[b] / 1e6 for b, mb in mb_keys.items() if r.get(b) is not None}} if "error" not in r else r
        for r in records
    ]


def summarise(
    data: dict[str, Any],
    mb_keys: Mapping[str, str],
    keys: Sequence[str],
    ratio_keys: Sequence[str],
    pairs: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """The harness's summary of ``keys``; ``<key>_ratio`` of each ``(arm, base)`` pair, per repeat, for
    ``ratio_keys``; and per arm its ``first`` run (the per-rank figures, deterministic but for the RSS, of one run)."""
    records = with_mb(data["records"], mb_keys)
    s: dict[str, Any] = harness.summarise(records, list(data["arms"]), keys)
    for arm, base in pairs:
        if arm in s:
            for key in ratio_keys:
                s[arm][f"{key}_ratio"] = harness.paired(records, arm, base, key)
    for arm in data["arms"]:
        s[arm]["first"] = min(harness.ok(records, arm), key=lambda r: r["repeat"], default=None)
    return s


def progress(record: dict[str, Any]) -> str:
    """One run's line while the benchmark runs."""
    return (
        f"{record['step_ms']:.2f} ms/step, state {record['state_bytes_max'] / 1e6:.3f} MB,"
        f" payload {record['sent_bytes_max'] / 1e6:.3f} MB/step (largest rank, counted)"
    )


def parameters(data: dict[str, Any]) -> str:
    """The workload's parameter count, as the page writes it (``?`` when no run succeeded)."""
    s = data["summary"]
    params = next((v["first"]["parameters"] for a, v in s.items() if a in data["arms"] and v["first"]), None)
    return f"{params:,}" if params else "?"


def per_rank_state(first: Mapping[str, Any]) -> str:
    """One run's optimizer state per rank in MB, ``rank 0 / 1 / ...`` (``-`` for none)."""
    return " / ".join(f"{b / 1e6:.3f}" for b in first.get("state_bytes_ranks", [])) or "-"


def batch(data: dict[str, Any]) -> str:
    """The batch per process, in windows of tokens on the GPT."""
    model = data.get("workload", {}).get("model", "digits")
    windows = f" windows of {data['workload'].get('block_size')} tokens" if model == "gpt" else ""
    return f"{data['settings']['batch_size']}{windows}"


def target_cells(target: Mapping[str, Any]) -> list[str]:
    """A target's ratio, limit and verdict, as table cells."""
    return [
        fmt(target["ratio"], ".3f"),
        f"<= {target['limit']:.2f}x" if target["limit"] is not None else "-",
        f"**{target['verdict']}**" if target["verdict"] != "-" else "-",
    ]


def failed(data: dict[str, Any]) -> list[str]:
    """The page's list of failed runs (nothing when none failed)."""
    errors = [f"{a}: {e}" for a in data["arms"] for e in data["summary"][a]["errors"]]
    return ["", "Failed runs:", *(f"- {f}" for f in errors)] if errors else []


def plot(
    benchmark: harness.Benchmark, data: dict[str, Any], out: Path, bytes_panel: Panel, title: str, colors: Any
) -> list[Path]:
    """The state, step-time and ``bytes_panel`` bars of every arm, with their ratios, in one PNG."""
    s = data["summary"]
    path = out / f"{harness.stem(benchmark, data['settings'].get('model'))}.png"
    harness.bar_panels(
        path,
        {a: s[a] for a in data["arms"]},
        [
            Panel("state_mb_max", "optimizer state, largest rank (MB)", "state_mb_max_ratio"),
            Panel("step_ms", "median step (ms)", "step_ms_ratio"),
            bytes_panel,
        ],
        title=f"{title} (min-max over repeats)",
        colors=colors,
    )
    return [path]
