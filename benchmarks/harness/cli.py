"""The one command line every benchmark script shares, and the run / write / re-render cycle behind it."""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .provenance import provenance
from .run import package_state, run_experiment
from .spec import Arm, Experiment
from .writers import read_json, verdict_lines, write_json, write_markdown

RESULTS = Path(__file__).resolve().parents[1] / "results"


class Benchmark:
    """One benchmark script: subclass it with the experiment and the reading, and call :func:`main`."""

    name: str = ""
    description: str = ""
    #: the workloads ``--model`` offers; results of another than the first go to ``<name>_<model>.*``
    models: tuple[str, ...] = ("digits",)
    defaults: dict[str, Any] = {"repeats": 3}  # option values of a full run
    quick: dict[str, Any] = {"repeats": 1}  # ... and of a ``--quick`` smoke test

    def options(self, parser: argparse.ArgumentParser) -> None:
        """Add this benchmark's own options; leave a default ``None`` to take it from :attr:`defaults`/:attr:`quick`."""

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        """What the JSON records about the machine and the setup besides the options (e.g. the CPU's name)."""
        return {}

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        """The arms to compare and their repeats."""
        raise NotImplementedError

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        """Run one arm once and read its figures (a flat dict); raise :class:`harness.Failed` for no result."""
        raise NotImplementedError

    def progress(self, record: dict[str, Any]) -> str:
        """One console line about a finished run."""
        return f"median step {record['median_step_ms']:.2f} ms" if "median_step_ms" in record else "done"

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        """Run everything; the JSON's body (``records`` at least)."""
        experiment = self.experiment(opts)
        records = run_experiment(experiment, lambda arm, rep: self.run(arm, rep, opts), self.progress)
        arms = {a.name: a.title for a in experiment.arms}
        return {"arms": arms, "baseline": experiment.baseline, "records": records}

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        """The summary from ``data["records"]``, with ``"verdicts"``: every target, :func:`harness.judged`."""
        raise NotImplementedError

    def report(self, data: dict[str, Any]) -> list[str]:
        """The markdown's lines, from ``data`` (with its ``summary``)."""
        raise NotImplementedError

    def compact(self, data: dict[str, Any]) -> dict[str, Any]:
        """The JSON's body with per-step series summarised; :meth:`summarise` must give the same summary from it."""
        return data

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        """Write the charts into ``out``; the paths written."""
        return []

    def file_stem(self, settings: dict[str, Any]) -> str:
        """The results' file stem for a run with these settings."""
        return stem(self, settings.get("model"))


def parser(bench: Benchmark) -> argparse.ArgumentParser:
    """The shared options, then the benchmark's own."""
    p = argparse.ArgumentParser(description=bench.description, formatter_class=argparse.RawDescriptionHelpFormatter)
    quick = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in bench.quick.items())
    p.add_argument("--quick", action="store_true", help=f"a smoke test: {quick}")
    p.add_argument("--repeats", type=int, default=None, help="interleaved runs of every arm (full run: %(default)s)")
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/results; a temp folder with --quick)"
    )
    p.add_argument(
        "--render",
        nargs="?",
        const="",
        default=None,
        metavar="JSON",
        help=f"run nothing: re-read the JSON (default <out>/{bench.name}.json) and rewrite its markdown and PNG",
    )
    p.add_argument(
        "--model",
        choices=bench.models,
        default=bench.models[0],
        help="the workload: " + " or ".join(bench.models) + f" (results of other than {bench.models[0]} go to"
        f" {bench.name}_<model>.*)",
    )
    bench.options(p)
    return p


def stem(bench: Benchmark, model: str | None) -> str:
    """The results' file stem: the benchmark's name, with the workload's when it is not the first one."""
    return bench.name if model in (None, bench.models[0]) else f"{bench.name}_{model}"


def resolve(bench: Benchmark, opts: argparse.Namespace) -> argparse.Namespace:
    """Fill every option left ``None`` from the full or quick defaults, and the output folder."""
    for key, value in {**bench.defaults, **(bench.quick if opts.quick else {})}.items():
        if getattr(opts, key, None) is None:
            setattr(opts, key, value)
    if opts.repeats is not None and opts.repeats < 1:
        raise SystemExit(f"--repeats {opts.repeats}: give at least 1")
    if opts.out is None:  # a smoke test never overwrites the real results
        if opts.render:
            opts.out = Path(opts.render).parent
        else:
            opts.out = Path(tempfile.mkdtemp(prefix=f"ds-{bench.name}-quick-")) if opts.quick else RESULTS
    return opts


def write(bench: Benchmark, data: dict[str, Any], out: Path, json_too: bool = True) -> list[Path]:
    """Summarise, then write the JSON (unless re-rendering), the markdown (printed) and the charts."""
    data["summary"] = bench.summarise(data)
    name = bench.file_stem(data.get("settings", {}))
    if json_too:
        write_json(out / f"{name}.json", bench.compact(data))
    write_markdown(out / f"{name}.md", [*bench.report(data), *verdict_lines(data["summary"].get("verdicts"))])
    return [*([out / f"{name}.json"] if json_too else []), out / f"{name}.md", *bench.plot(data, out)]


def main(bench: Benchmark, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse the shared command line, then run and write, or (``--render``) re-render; the data written."""
    opts = resolve(bench, parser(bench).parse_args(argv))
    if opts.render is not None:
        stored = read_json(Path(opts.render) if opts.render else opts.out / f"{bench.file_stem(vars(opts))}.json")
        written = write(bench, stored, opts.out, json_too=False)
        print(f"re-rendered {', '.join(p.name for p in written)} in {opts.out}", flush=True)
        return stored
    start = time.monotonic()
    package = package_state()
    meta = bench.meta(opts)  # may complete the options (e.g. "auto" resolved): the settings record the result
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items() if k not in ("out", "render")}
    data: dict[str, Any] = {
        "benchmark": bench.name,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": settings,
        "package": package,
        "provenance": provenance(),
        **meta,
    }
    data.update(bench.collect(opts))
    data["seconds"] = time.monotonic() - start
    if package_state() != package:  # every run imports the package afresh: say so if it changed
        data["package_at_end"] = package_state()
        print("  note: the package changed while the benchmark ran (see package / package_at_end)", flush=True)
    written = write(bench, data, opts.out)
    print(f"wrote {', '.join(p.name for p in written)} to {opts.out} in {data['seconds'] / 60:.1f} min", flush=True)
    return data
