"""``make bench-all``: every benchmark target of the Makefile in turn, then one summary of every result
(``results/bench_all.{json,md}``); see ``benchmarks/README.md``.

    python -m benchmarks.harness.bench_all [--targets bench-mirrored ...] [--summary-only] [--results DIR]
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

NAME = "bench_all"
#: what one ``make bench-all`` may take
BUDGET_MINUTES = 120.0


def _and_gpt(short: str, stem: str) -> dict[str, tuple[str, ...]]:
    return {f"bench-{short}": (stem,), f"bench-{short}-gpt": (f"{stem}_gpt",)}


#: the results files (stems in ``results/``) each make target writes; bench-precision-ops writes a page, no JSON
WRITES: dict[str, tuple[str, ...]] = {
    **_and_gpt("mirrored", "mirrored"),
    **_and_gpt("pipeline", "pipeline"),
    **_and_gpt("ps", "parameter_server"),
    **_and_gpt("balance", "load_balance"),
    **_and_gpt("precision", "precision"),
    "bench-precision-ops": (),
    **_and_gpt("memory", "memory"),
    **_and_gpt("sharding", "sharding_engines"),
    "bench-collectives": ("collectives",),
    "bench-faults": ("faults",),
    **_and_gpt("cluster", "cluster"),
    **_and_gpt("cluster-hierarchical", "cluster_hierarchical"),
    "bench-report": ("report_overhead",),
    "bench-link": ("link_attribution",),
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
            rc: int | str = subprocess.run(["make", "--no-print-directory", target], cwd=REPO, check=False).returncode
        except KeyboardInterrupt:
            rc = "interrupted"
        runs.append({"target": target, "minutes": (time.monotonic() - start) / 60, "exit": rc})
        if rc == "interrupted":
            print("bench-all: interrupted; the summary covers what ran", flush=True)
            break
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


def _folders(folder: str) -> list[str]:
    """``folder`` and every benchmark folder its code imports from, directly or through another."""
    found = [folder]
    for name in found:
        for path in sorted((REPO / "benchmarks" / name).glob("*.py")):
            for other in re.findall(r"\bbenchmarks\.(\w+)", path.read_text()):
                if other not in (*found, "harness", "results") and (REPO / "benchmarks" / other).is_dir():
                    found.append(other)
    return found


def measured_paths(benchmark: str | None) -> tuple[str, ...]:
    """What a results file of ``benchmark`` measured, as git pathspecs: the package, the harness, the benchmark's folder
    and those it imports from; all of ``benchmarks/`` when it is unknown."""
    module = BENCHMARKS.get(benchmark or "", ("",))[0]
    if not module:
        return MEASURED
    folders = tuple(f"benchmarks/{f}" for f in _folders(module.split(".")[0]))
    return ("ds_lightning", "benchmarks/harness", *folders, *MEASURED[2:])


def changed_since(commit: str, paths: Sequence[str] = MEASURED) -> list[str] | None:
    """The files of ``paths`` that differ between ``commit`` and HEAD; ``None`` if git cannot tell."""
    args = ["git", "diff", "--name-only", commit, "HEAD", "--", *paths]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    return proc.stdout.split() if proc.returncode == 0 else None


def _code_flag(commit: str | None, head: str, benchmark: str | None) -> str | None:
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


def _started(data: dict[str, Any]) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(data["started"])
    except (KeyError, TypeError, ValueError):
        return None


def _files(
    results: dict[str, dict[str, Any]],
    commits: Counter,
    code: dict[str, str | None],
    since: datetime.datetime | None,
    defaults: dict[str, int],
) -> list[dict[str, Any]]:
    """One row per results file: commit, date, launches, seconds, and every flag against one run at one commit."""
    common, count = commits.most_common(1)[0] if commits else (None, 0)
    written = {stem for stems in WRITES.values() for stem in stems}
    rows = []
    for stem, data in results.items():
        st, package = data.get("settings") or {}, data.get("package") or {}
        commit, repeats, started = package.get("commit") or None, st.get("repeats"), _started(data)
        few, default = repeats is None or repeats < MIN_LAUNCHES, defaults.get(stem, repeats)
        flags = [
            f"commit differs from the most common ({_short(common)}, {count} of {len(results)} files)"
            if commit != common
            else None,
            code[stem],
            "uncommitted package changes" if package.get("uncommitted") else None,
            f"{repeats} launch(es) per arm, under {MIN_LAUNCHES}: not judged" if few else None,
            f"{repeats} launches per arm, not the default {default}" if not few and repeats != default else None,
            "a --quick run" if st.get("quick") else None,
            "not rewritten by this run" if since and (started is None or started < since) else None,
            "written by no bench-all target" if stem not in written else None,
        ]
        rows.append(
            {
                "file": f"{stem}.json",
                "commit": commit,
                "date": (data.get("provenance") or {}).get("date") or data.get("started"),
                "repeats": repeats,
                "quick": bool(st.get("quick")),
                "seconds": data.get("seconds"),
                "flags": [f for f in flags if f],
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
    """The summary of ``runs`` (:func:`run_targets`; empty for ``--summary-only``) and every results file in
    ``folder``; ``since``, when this run started, flags the files it did not rewrite (``None``: no run)."""
    package = package_state()
    head = package["commit"]
    results = load(folder)
    defaults = {s: _benchmark(d["benchmark"]).defaults.get("repeats", MIN_LAUNCHES) for s, d in results.items()}
    ran = {r["target"]: r for r in runs}
    rows: list[dict[str, Any]] = []
    verdicts, sources = [], {}
    for target in targets:
        stems, run = WRITES.get(target, ()), ran.get(target)
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
        for stem in (s for s in stems if s in results):
            found, sources[stem] = verdicts_of(results[stem])
            verdicts += [{"benchmark": stem, **v} for v in found]
    counts: dict[str, int] = {v: sum(x["verdict"] == v for x in verdicts) for v in VERDICTS}
    counts.update(total=len(verdicts), files=len(results))
    commits = Counter((d.get("package") or {}).get("commit") for d in results.values())
    # the code each file measured (measured_paths) is HEAD's: results committed after a run stay current
    code = {
        s: _code_flag((d.get("package") or {}).get("commit") or None, head, d.get("benchmark"))
        for s, d in results.items()
    }
    estimated = sum(r["estimated_minutes"] or 0.0 for r in rows)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    yes = {True: "yes", False: "no"}
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
            "unknown": [r["target"] for r in rows if r["estimated_minutes"] is None],
            "over_budget": yes[estimated > BUDGET_MINUTES],
        },
        "commits": {
            "head": head or None,
            "distinct": len(commits),
            "most_common": next(iter(commits.most_common(1)), (None, 0))[0],
            "one_commit": yes[len(commits) == 1],
            "at_head": yes[set(commits) == {head}],
            "code_unchanged": yes[all(flag is None for flag in code.values())],
        },
        "counts": counts,
        "verdicts_from": sources,
        "files": _files(results, commits, code, since, defaults),
        "verdicts": verdicts,
    }


def _minutes(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown(data: dict[str, Any]) -> list[str]:
    """The summary page."""
    m, c, n = data["minutes"], data["commits"], data["counts"]
    if data["mode"] == "summary-only":
        how = "`--summary-only`: nothing ran; built from the results files already in `benchmarks/results/`"
    else:
        how = f"a `make bench-all` run of {sum(r['ran'] for r in data['targets'])} target(s)"
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
            *(_minutes(r[k]) for k in ("minutes", "recorded_minutes", "estimated_minutes")),
        ]
        for r in data["targets"]
    ]
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
        f"{n['total']} targets: {', '.join(f'{n[v]} {v}' for v in VERDICTS)}. Each is the median over launches"
        " [min - max], judged by the harness's rule (`harness.verdict`: met when the median meets the target, within"
        f" noise when the spread reaches it, not judged under {MIN_LAUNCHES} launches)."
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
