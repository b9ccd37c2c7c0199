"""``make bench-all``: every benchmark target of the Makefile in turn, then one summary of every result.

Runs each target of the Makefile's ``BENCH_TARGETS`` (``make --no-print-directory <target>``), timing it and going on
past a failed one; then writes ``results/bench_all.json`` and ``results/bench_all.md``: per target its minutes and exit
status; every target of every benchmark (its ``summary["verdicts"]``: what, target, median [min - max] over launches,
launches, verdict); each results file's commit, flagged where it differs from the others' or where the code it measured
(``ds_lightning/``, the harness and its benchmark's folder) changed between it and HEAD, where it rests
on fewer than ``harness.MIN_LAUNCHES`` launches per arm or on a ``--quick`` run, or where this run did not rewrite it;
and the total minutes against the 2-hour budget.

    python -m benchmarks.harness.bench_all [--targets bench-mirrored ...] [--summary-only] [--results DIR]

``--summary-only`` runs nothing: it builds the summary from the JSON already in the results folder. A file written
before ``summary["verdicts"]`` existed is summarised again from its records by its driver, in memory (the file is left
as it is). Without a run, each target's minutes are estimated from its results file: the ``seconds`` that run took,
scaled to the driver's default launches per arm.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cli import RESULTS
from .compact import BENCHMARKS
from .run import MEASURED, REPO, package_state
from .verdict import MIN_LAUNCHES, VERDICTS
from .writers import judged_figure, markdown_table, write_json, write_markdown

__all__ = ["BUDGET_MINUTES", "WRITES", "bench_targets", "build", "main", "markdown"]

NAME = "bench_all"
#: what one ``make bench-all`` may take
BUDGET_MINUTES = 120.0
#: the results files (stems in ``results/``) each make target writes; bench-precision-ops writes a page, no JSON
WRITES: dict[str, tuple[str, ...]] = {
    "bench-mirrored": ("mirrored",),
    "bench-mirrored-gpt": ("mirrored_gpt",),
    "bench-pipeline": ("pipeline",),
    "bench-pipeline-gpt": ("pipeline_gpt",),
    "bench-ps": ("parameter_server",),
    "bench-ps-gpt": ("parameter_server_gpt",),
    "bench-balance": ("load_balance",),
    "bench-balance-gpt": ("load_balance_gpt",),
    "bench-precision": ("precision",),
    "bench-precision-gpt": ("precision_gpt",),
    "bench-precision-ops": (),
    "bench-memory": ("memory",),
    "bench-memory-gpt": ("memory_gpt",),
    "bench-sharding": ("sharding_engines",),
    "bench-sharding-gpt": ("sharding_engines_gpt",),
    "bench-collectives": ("collectives",),
    "bench-faults": ("faults",),
    "bench-cluster": ("cluster",),
    "bench-cluster-gpt": ("cluster_gpt",),
    "bench-cluster-hierarchical": ("cluster_hierarchical",),
    "bench-cluster-hierarchical-gpt": ("cluster_hierarchical_gpt",),
}


def bench_targets(makefile: Path = REPO / "Makefile") -> list[str]:
    """The Makefile's ``BENCH_TARGETS``, in order."""
    match = re.search(r"^BENCH_TARGETS\s*:=\s*(.*)$", makefile.read_text().replace("\\\n", " "), re.MULTILINE)
    if match is None:
        raise SystemExit(f"bench-all: {makefile} defines no BENCH_TARGETS := ...")
    return match[1].split()


def run_targets(targets: Sequence[str]) -> list[dict[str, Any]]:
    """``make`` each target in turn; its minutes and exit status, going on past a failure (an interrupt stops)."""
    runs: list[dict[str, Any]] = []
    for i, target in enumerate(targets, 1):
        print(f"bench-all: {target} ({i} of {len(targets)})", flush=True)
        start = time.monotonic()
        try:
            rc = subprocess.run(["make", "--no-print-directory", target], cwd=REPO, check=False).returncode
        except KeyboardInterrupt:
            runs.append({"target": target, "minutes": (time.monotonic() - start) / 60, "exit": "interrupted"})
            print("bench-all: interrupted; the summary covers what ran", flush=True)
            break
        runs.append({"target": target, "minutes": (time.monotonic() - start) / 60, "exit": rc})
        done = "done" if rc == 0 else f"FAILED (exit {rc}); going on"
        print(f"bench-all: {target} {done} in {runs[-1]['minutes']:.1f} min", flush=True)
    return runs


def load(folder: Path) -> dict[str, dict[str, Any]]:
    """Every benchmark results JSON in ``folder`` by stem (traces, this summary and unreadable files left out)."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        if path.stem == NAME or "_trace_" in path.stem:
            continue
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("benchmark") in BENCHMARKS:
            out[path.stem] = data
    return out


def _benchmark(name: str) -> Any:
    module, cls = BENCHMARKS[name]
    return getattr(importlib.import_module(f"benchmarks.{module}"), cls)()


def verdicts_of(data: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """A results file's verdicts, and where they come from: its summary, or its records summarised again now."""
    written = (data.get("summary") or {}).get("verdicts")
    if isinstance(written, list):
        return written, "written"
    fresh = _benchmark(data["benchmark"]).summarise(copy.deepcopy(data))
    return list(fresh.get("verdicts") or []), "summarised again from its records"


def _short(commit: str | None) -> str:
    return commit[:10] if commit else "unrecorded"


def commit_of(data: dict[str, Any]) -> str | None:
    """The commit a results file was measured at."""
    return (data.get("package") or {}).get("commit") or None


def _started(data: dict[str, Any]) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(data["started"])
    except (KeyError, TypeError, ValueError):
        return None


def _folders(folder: str) -> list[str]:
    """``folder`` and every benchmark folder its code imports from, directly or through another (memory reads its
    counts from sharding_engines, the cluster its balancer reading from load_balance)."""
    found = [folder]
    for name in found:
        for path in sorted((REPO / "benchmarks" / name).glob("*.py")):
            for other in re.findall(r"\bbenchmarks\.(\w+)", path.read_text()):
                if (
                    other not in found
                    and other not in ("harness", "results")
                    and (REPO / "benchmarks" / other).is_dir()
                ):
                    found.append(other)
    return found


def measured_paths(benchmark: str | None) -> tuple[str, ...]:
    """What a results file of ``benchmark`` measured, as git pathspecs: the package, the harness, the benchmark's own
    folder and the folders it imports from (a benchmark it does not import changes none of its figures); all of
    ``benchmarks/`` when it is unknown."""
    module = BENCHMARKS.get(benchmark or "", ("",))[0]
    if not module:
        return MEASURED
    folders = tuple(f"benchmarks/{f}" for f in _folders(module.split(".")[0]))
    return ("ds_lightning", "benchmarks/harness", *folders, *MEASURED[2:])


def changed_since(commit: str, paths: Sequence[str] = measured_paths(None)) -> list[str] | None:
    """The files of ``paths`` that differ between ``commit`` and HEAD; ``None`` if git cannot tell."""
    proc = subprocess.run(
        ["git", "diff", "--name-only", commit, "HEAD", "--", *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.stdout.split() if proc.returncode == 0 else None


def _code_flag(commit: str | None, head: str, benchmark: str | None = None) -> str | None:
    """Why a file of ``benchmark`` measured at ``commit`` may not describe HEAD's code; ``None`` when it does."""
    if commit == head:
        return None
    changed = changed_since(commit, measured_paths(benchmark)) if commit else None
    if changed is None:
        return "commit unknown here: cannot tell whether the measured code changed since"
    if changed:
        shown = ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")
        return f"measured code changed since: {len(changed)} file(s) ({shown})"
    return None


def _files(
    results: dict[str, dict[str, Any]], head: str, since: datetime.datetime | None, defaults: dict[str, int]
) -> list[dict[str, Any]]:
    """One row per results file: commit, date, launches, seconds, and every flag against one run at one commit."""
    commits = Counter((d.get("package") or {}).get("commit") for d in results.values())
    common, count = commits.most_common(1)[0] if commits else (None, 0)
    written = {stem for stems in WRITES.values() for stem in stems}
    rows = []
    for stem, data in results.items():
        st, package = data.get("settings") or {}, data.get("package") or {}
        commit, repeats = package.get("commit") or None, st.get("repeats")
        flags = []
        if commit != common:
            flags.append(f"commit differs from the most common ({_short(common)}, {count} of {len(results)} files)")
        code = _code_flag(commit, head, data.get("benchmark"))
        if code:
            flags.append(code)
        if package.get("uncommitted"):
            flags.append("uncommitted package changes")
        if repeats is None or repeats < MIN_LAUNCHES:
            flags.append(f"{repeats} launch(es) per arm, under {MIN_LAUNCHES}: not judged")
        elif repeats != defaults.get(stem, repeats):
            flags.append(f"{repeats} launches per arm, not the default {defaults[stem]}")
        if st.get("quick"):
            flags.append("a --quick run")
        started = _started(data)
        if since is not None and (started is None or started < since):
            flags.append("not rewritten by this run")
        if stem not in written:
            flags.append("written by no bench-all target")
        rows.append(
            {
                "file": f"{stem}.json",
                "commit": commit,
                "date": (data.get("provenance") or {}).get("date") or data.get("started"),
                "repeats": repeats,
                "quick": bool(st.get("quick")),
                "seconds": data.get("seconds"),
                "flags": flags,
            }
        )
    return rows


def _estimate(stems: Sequence[str], results: dict[str, dict[str, Any]], defaults: dict[str, int]) -> float | None:
    """A target's minutes from its files' recorded ``seconds``, scaled to the default launches per arm."""
    total = 0.0
    for stem in stems:
        data = results.get(stem)
        if not data or not data.get("seconds"):
            return None
        repeats = (data.get("settings") or {}).get("repeats") or 1
        total += data["seconds"] / 60 * defaults.get(stem, repeats) / repeats
    return total if stems else None


def build(
    targets: Sequence[str], runs: Sequence[dict[str, Any]], folder: Path, since: datetime.datetime | None = None
) -> dict[str, Any]:
    """The summary: ``runs`` (:func:`run_targets`, empty for ``--summary-only``) and every results file in ``folder``.

    Args:
        targets: every bench-all target, in order.
        runs: what this run ran.
        folder: the results folder.
        since: when this run started (files started before it are flagged as not rewritten); ``None``: no run.

    """
    package = package_state()
    head = package["commit"]
    results = load(folder)
    defaults = {
        stem: _benchmark(data["benchmark"]).defaults.get("repeats", MIN_LAUNCHES) for stem, data in results.items()
    }
    ran = {r["target"]: r for r in runs}
    rows: list[dict[str, Any]] = []
    for target in targets:
        stems = WRITES.get(target, ())
        run = ran.get(target)
        recorded = [results[s]["seconds"] / 60 for s in stems if results.get(s, {}).get("seconds")]
        rows.append(
            {
                "target": target,
                "files": [f"{s}.json" for s in stems],
                "ran": run is not None,
                "exit": run["exit"] if run else None,
                "minutes": run["minutes"] if run else None,
                "recorded_minutes": sum(recorded) if stems and len(recorded) == len(stems) else None,
                "estimated_minutes": run["minutes"] if run else _estimate(stems, results, defaults),
            }
        )
    verdicts, sources = [], {}
    for target in targets:
        for stem in WRITES.get(target, ()):
            if stem in results:
                found, sources[stem] = verdicts_of(results[stem])
                verdicts += [{"benchmark": stem, **v} for v in found]
    counts: dict[str, int] = {v: sum(x["verdict"] == v for x in verdicts) for v in VERDICTS}
    counts.update(total=len(verdicts), files=len(results))
    commits = Counter((d.get("package") or {}).get("commit") for d in results.values())
    unknown = [r["target"] for r in rows if r["estimated_minutes"] is None]
    estimated = sum(r["estimated_minutes"] or 0.0 for r in rows)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {
        "benchmark": NAME,
        "mode": "summary-only" if since is None else "run",
        "started": since.isoformat(timespec="seconds") if since else now,
        "package": package,
        "provenance": {"commit": head or None, "uncommitted": package["uncommitted"], "date": now},
        "targets": rows,
        "minutes": {
            "budget": BUDGET_MINUTES,
            "run": sum(r["minutes"] for r in rows if r["ran"]) if runs else None,
            "estimated": estimated,
            "unknown": unknown,
            "over_budget": "yes" if estimated > BUDGET_MINUTES else "no",
        },
        "commits": {
            "head": head or None,
            "distinct": len(commits),
            "most_common": next(iter(commits.most_common(1)), (None, 0))[0],
            "one_commit": "yes" if len(commits) == 1 else "no",
            "at_head": "yes" if set(commits) == {head} else "no",
            # the code each file measured (measured_paths) is HEAD's: results committed after a run stay current
            "code_unchanged": "yes"
            if all(_code_flag(commit_of(d), head, d.get("benchmark")) is None for d in results.values())
            else "no",
        },
        "counts": counts,
        "verdicts_from": sources,
        "files": _files(results, head, since, defaults),
        "verdicts": verdicts,
    }


def _minutes(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown(data: dict[str, Any]) -> list[str]:
    """The summary page."""
    m, c, n = data["minutes"], data["commits"], data["counts"]
    how = (
        "`--summary-only`: nothing ran; built from the results files already in `benchmarks/results/`"
        if data["mode"] == "summary-only"
        else f"a `make bench-all` run of {sum(r['ran'] for r in data['targets'])} target(s)"
    )
    flagged = [f for f in data["files"] if f["flags"]]
    if c["one_commit"] == "yes" and c["code_unchanged"] == "yes" and not flagged:
        commits = (
            f"All {n['files']} results files were measured at {_short(c['most_common'])}, none flagged; the measured"
            f" code (`ds_lightning/`, the harness, each benchmark's folder) is the same at HEAD {_short(c['head'])}."
        )
    else:
        commits = (
            f"**NOT ONE RUN AT ONE COMMIT: the {n['files']} results files come from {c['distinct']} commit(s)"
            f" (HEAD {_short(c['head'])}); {len(flagged)} file(s) flagged below.**"
        )
    over = m["over_budget"] == "yes"
    budget = (
        f"{'**OVER BUDGET**: ' if over else ''}{_minutes(m['estimated'])} min"
        f" {'measured' if data['mode'] == 'run' and not m['unknown'] else 'estimated'} for every target against the"
        f" {m['budget'] / 60:g}-hour budget ({m['budget']:.0f} min){'' if over else ': within budget'}"
        + (f"; no figure for {', '.join(m['unknown'])}" if m["unknown"] else "")
        + "."
    )
    time_rows = [
        [
            f"`{r['target']}`",
            ", ".join(f"`{f}`" for f in r["files"]) or "none (a page)",
            "-" if r["exit"] is None else ("ok" if r["exit"] == 0 else f"**FAILED ({r['exit']})**"),
            _minutes(r["minutes"]),
            _minutes(r["recorded_minutes"]),
            _minutes(r["estimated_minutes"]),
        ]
        for r in data["targets"]
    ]
    counted = ", ".join(f"{n[v]} {v}" for v in VERDICTS)
    verdict_rows = [
        [v["benchmark"], v["what"], v["target"], judged_figure(v), v["launches"], v["verdict"]]
        for v in data["verdicts"]
    ]
    again = [s for s, how in data["verdicts_from"].items() if how != "written"]
    file_rows = [
        [
            f["file"],
            _short(f["commit"]),
            str(f["date"] or "-")[:10],
            f["repeats"],
            "; ".join(f"**{x}**" for x in f["flags"]) or "-",
        ]
        for f in data["files"]
    ]
    return [
        "# make bench-all: every benchmark, one summary",
        "",
        f"Built {data['started'][:10]} at commit {_short(c['head'])}: {how}.",
        "",
        commits,
        "",
        budget,
        "",
        "## Time",
        "",
        "Minutes per make target: of this run; recorded (the `seconds` of the run that wrote its results file); and"
        " estimated (this run's, else the recorded minutes scaled to the driver's default launches per arm).",
        "",
        *markdown_table(["make target", "results", "exit", "this run", "recorded", "estimated"], time_rows),
        "",
        "## Verdicts",
        "",
        f"{n['total']} targets: {counted}. Each is the median over launches [min - max], judged by the harness's rule"
        " (`harness.verdict`: met when the median meets the target, within noise when the spread reaches it, not"
        f" judged under {MIN_LAUNCHES} launches)."
        + (
            f" Summarised again from their records (written before `summary.verdicts`): {', '.join(again)}."
            if again
            else ""
        ),
        "",
        *markdown_table(["benchmark", "what", "target", "median [min - max]", "launches", "verdict"], verdict_rows),
        "",
        "## Results files",
        "",
        *markdown_table(["file", "commit", "date", "launches per arm", "flags"], file_rows),
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the targets (unless ``--summary-only``), then write the summary; exit 1 if a target failed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", metavar="TARGET", help="make targets to run (default: every BENCH_TARGETS)")
    p.add_argument("--summary-only", action="store_true", help="run nothing: summarise the results already there")
    p.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default benchmarks/results)")
    opts = p.parse_args(argv)
    targets = bench_targets()
    unlisted = [t for t in targets if t not in WRITES]
    if unlisted:
        raise SystemExit(f"bench-all: {unlisted} not in bench_all.WRITES: name the results files each one writes")
    unknown = [t for t in opts.targets or () if t not in targets]
    if unknown:
        raise SystemExit(f"bench-all: {unknown} not in the Makefile's BENCH_TARGETS: {' '.join(targets)}")
    since = None if opts.summary_only else datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    runs = [] if opts.summary_only else run_targets(opts.targets or targets)
    data = build(targets, runs, opts.results, since)
    write_json(opts.results / f"{NAME}.json", data)
    write_markdown(opts.results / f"{NAME}.md", markdown(data))
    failed = [r["target"] for r in runs if r["exit"] != 0]
    if failed:
        raise SystemExit(f"bench-all: {len(failed)} target(s) failed: {' '.join(failed)} (summary written)")
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
