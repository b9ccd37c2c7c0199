"""MkDocs hook: every measured figure in the docs is read from ``benchmarks/results/*.json`` when the site builds.

A page writes a reference where the figure goes, never the number::

    {{ result("mirrored_gpt", "summary.ds_mirrored.over_plain_ddp") }}            -> 1.11 [0.849 - 1.13]
    {{ result("mirrored_gpt", "summary.ds_mirrored.over_plain_ddp.median", fmt=".3f") }}  -> 1.113
    {{ result("memory", "summary.fsdp2.state_ratio.median", fmt=".1%") }}         -> 50.0%
    {{ result("mirrored", "summary.ds_mirrored.comm_bytes_per_step.median", scale=1e-6, fmt=".2f") }} -> 4.51
    {{ ratio("mirrored", "summary.powersgd.comm_bytes_per_step.median",
             "summary.ds_mirrored.comm_bytes_per_step.median", fmt=".3f") }}  -> 0.021 (two figures of one file)
    {{ provenance("mirrored") }}  -> where mirrored.json was measured (commit, date, CPU, cores, torch, Lightning)
    {{ verdict("cluster_hierarchical", "two_level/flat: step-time speed-up") }}  -> missed

``verdict(benchmark, what)`` reads the verdict (met, within noise, missed, not judged) of one target from
``bench_all.json``, the summary ``make bench-all`` writes; ``what`` is the target's description or its start, and must
name exactly one of that benchmark's targets. A page never types whether a target was met.

The first argument names ``benchmarks/results/<name>.json``; the second is a dotted path into it. A list is indexed by
number, or by fields: ``summary.configs.p=2,schedule=1F1B,m=8.ratio`` takes the one entry with those fields, and fails
when none or several match. A key that itself holds a dot is given as a list of keys instead. A path that ends at a
spread (a mapping with ``median``, ``min`` and ``max``, as the harness writes) renders as ``median [min - max]``;
``spread=False`` gives the median alone. ``fmt`` is a format spec (default ``.3g``), applied after multiplying by
``scale``.

Each page that reads results gets a closing note with the provenance of every file it read: the commit, the date, the
CPU model and cores, and the torch and Lightning versions. A field a results file does not record (files written
before the harness recorded it) shows as "unrecorded"; nothing is guessed.

A reference to a file or key that does not exist, or to a value that is not a figure, is a warning naming the page,
the file and the key, so ``mkdocs build --strict`` fails. References in code spans and fenced blocks are left as they
are (so this docstring's syntax can be shown in a page). Markdown outside ``docs/`` (the README, published benchmark
READMEs) is read on GitHub as it is, so a reference there is a warning too: keep measured figures in the docs pages.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.results")

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
UNRECORDED = "unrecorded"
# Fenced blocks and inline code are skipped; outside them, every {{ result(...) }} or {{ provenance(...) }}.
_PATTERN = re.compile(
    r"(?P<code>^(?P<fence>`{3,}|~{3,})[^\n]*\n.*?^(?P=fence)|`[^`\n]*`)"
    r"|\{\{\s*(?P<call>result|ratio|provenance|verdict)\s*\((?P<args>[^{}]*?)\)\s*\}\}",
    re.MULTILINE | re.DOTALL,
)
#: ``scale=`` by name: bytes to these units, a fraction to percent points, or seconds to minutes
SCALES = {
    "KiB": 2**-10,
    "MiB": 2**-20,
    "GiB": 2**-30,
    "kB": 1e-3,
    "MB": 1e-6,
    "GB": 1e-9,
    "percent": 100,
    "minutes": 1 / 60,
}
PROVENANCE_FIELDS = ("commit", "date", "CPU", "cores", "torch", "Lightning")


class ResultReferenceError(ValueError):
    """A reference that names no figure; the message says which file and key, and what is there instead."""


@dataclass
class Rendered:
    """A page's markdown with its references replaced, the results files it read, and what failed."""

    markdown: str
    used: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _parse(args: str) -> tuple[list[Any], dict[str, Any]]:
    """The literal positional and keyword arguments of a reference (Python syntax, literals only)."""
    try:
        call = ast.parse(f"f({args})", mode="eval").body
        assert isinstance(call, ast.Call)
        return [ast.literal_eval(a) for a in call.args], {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, AssertionError) as exc:
        example = '("mirrored", "summary.ds_mirrored.step_ms")'
        raise ResultReferenceError(f"cannot read the arguments ({args}): give literals, e.g. {example}") from exc


def _select(items: list[Any], key: str, where: str) -> Any:
    """The one entry of ``items`` whose fields match ``key`` (``field=value,field=value``, compared as text).

    A page names a configuration this way instead of by its position, which moves when a benchmark's grid changes.
    """
    wanted = dict(part.split("=", 1) for part in key.split(","))
    found = [
        item for item in items if isinstance(item, Mapping) and all(str(item.get(k)) == v for k, v in wanted.items())
    ]
    if len(found) != 1:
        raise ResultReferenceError(f"{where}: '{key}' matches {len(found)} entries of its list, not one")
    return found[0]


class Results:
    """The results folder, each JSON read once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._cache: dict[str, dict[str, Any]] = {}

    def load(self, name: str) -> dict[str, Any]:
        """``<folder>/<name>.json``; a missing or unreadable file raises with the files there are."""
        name = name.removesuffix(".json")
        if name not in self._cache:
            path = self.folder / f"{name}.json"
            if not path.is_file():
                there = sorted(p.stem for p in self.folder.glob("*.json") if "_trace_" not in p.stem)
                raise ResultReferenceError(f"no results file {self._show(path)}; the results there: {', '.join(there)}")
            try:
                self._cache[name] = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ResultReferenceError(f"{self._show(path)} is not valid JSON ({exc})") from exc
        return self._cache[name]

    def _show(self, path: Path) -> str:
        return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)

    def lookup(self, name: str, path: str | Sequence[str | int]) -> Any:
        """The value at ``path`` (dotted, or a list of keys) in results file ``name``."""
        value: Any = self.load(name)
        keys = path.split(".") if isinstance(path, str) else list(path)
        where = f"{self._show(self.folder / name.removesuffix('.json'))}.json"
        for i, key in enumerate(keys):
            at = ".".join(str(k) for k in keys[:i]) or "the top level"
            if isinstance(value, Mapping):
                if str(key) not in value:
                    shown = ", ".join(list(map(str, value))[:20])
                    raise ResultReferenceError(f"{where} has no key '{key}' at {at} (keys there: {shown})")
                value = value[str(key)]
            elif isinstance(value, list) and "=" in str(key):
                value = _select(value, str(key), f"{where} at {at}")
            elif isinstance(value, list):
                if not str(key).lstrip("-").isdigit() or not -len(value) <= int(key) < len(value):
                    raise ResultReferenceError(f"{where}: '{key}' at {at} is not an index of its list of {len(value)}")
                value = value[int(key)]
            else:
                raise ResultReferenceError(f"{where}: {at} is a value ({value!r}), it has no key '{key}'")
        return value

    def provenance(self, name: str) -> dict[str, str]:
        """Where results file ``name`` was measured, field by field; "unrecorded" for what it does not record.

        Files written since the harness recorded provenance carry a ``provenance`` block; older ones are read for the
        same facts under the names they used then (``package.commit``, ``started``, ``cpus``, ``cpu``, ``torch``).
        """
        data = self.load(name)
        prov = data.get("provenance") or {}
        cpu = data.get("cpu") if isinstance(data.get("cpu"), Mapping) else {}
        machine = data.get("machine") if isinstance(data.get("machine"), Mapping) else {}
        package = data.get("package") if isinstance(data.get("package"), Mapping) else {}
        commit = prov.get("commit") or package.get("commit")
        dirty = prov.get("uncommitted", package.get("uncommitted"))
        date = prov.get("date") or data.get("started")
        cores = prov.get("cores") or data.get("cpus") or cpu.get("cores") or machine.get("cores")
        found = {
            "commit": f"{commit[:10]}{' + uncommitted changes' if dirty else ''}" if commit else None,
            "date": str(date)[:10] if date else None,
            "CPU": prov.get("cpu_model") or cpu.get("model"),
            "cores": str(cores) if cores else None,
            "torch": prov.get("torch") or data.get("torch"),
            "Lightning": prov.get("lightning"),
        }
        return {k: str(v) if v else UNRECORDED for k, v in found.items()}


def _number(value: Any, fmt: str | None, scale: float, where: str) -> str:
    """The value scaled and formatted; without ``fmt``, three significant digits, trailing zeros kept (1.10)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ResultReferenceError(f"{where} is {value!r}, not a number; name a number, or leave fmt and scale out")
    if fmt is None:
        return format(value * scale, "#.3g").rstrip(".")
    return format(value * scale, fmt)


def _figure(results: Results, args: list[Any], kwargs: dict[str, Any]) -> tuple[str, str]:
    """A ``result(...)`` reference's text, and the results file it read."""
    if len(args) != 2:
        raise ResultReferenceError(f"result() takes a results file and a key, got {len(args)} positional arguments")
    unknown = set(kwargs) - {"fmt", "scale", "spread"}
    if unknown:
        raise ResultReferenceError(f"result() has no option {sorted(unknown)}; its options: fmt, scale, spread")
    name, path = args
    fmt, scale = kwargs.get("fmt"), kwargs.get("scale", 1)
    if isinstance(scale, str):
        if scale not in SCALES:
            raise ResultReferenceError(f"scale={scale!r} is not a unit; give a number or one of {sorted(SCALES)}")
        scale = SCALES[scale]
    value = results.lookup(name, path)
    where = f"{name}.json key '{path if isinstance(path, str) else '.'.join(map(str, path))}'"
    if isinstance(value, Mapping) and {"median", "min", "max"} <= set(value):
        median = _number(value["median"], fmt, scale, where + " (median)")
        if not kwargs.get("spread", True):
            return median, name
        low, high = (_number(value[k], fmt, scale, f"{where} ({k})") for k in ("min", "max"))
        return f"{median} [{low} - {high}]", name
    if value is None:
        raise ResultReferenceError(f"{where} is null: the benchmark did not measure it")
    if isinstance(value, Mapping | list):
        raise ResultReferenceError(f"{where} is a {type(value).__name__}, not a figure: name a key inside it")
    if isinstance(value, str) and "fmt" not in kwargs and "scale" not in kwargs:
        return value, name
    return _number(value, fmt, scale, where), name


def _ratio(results: Results, args: list[Any], kwargs: dict[str, Any]) -> tuple[str, str]:
    """A ``ratio(file, numerator, denominator)`` reference's text: two numbers of one results file, divided."""
    if len(args) != 3 or set(kwargs) - {"fmt"}:
        raise ResultReferenceError("ratio() takes a results file, a numerator key and a denominator key, and fmt=")
    name, num, den = args
    values = [results.lookup(name, path) for path in (num, den)]
    for path, value in zip((num, den), values, strict=True):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ResultReferenceError(f"{name}.json key '{path}' is {value!r}, not a number")
    if values[1] == 0:
        raise ResultReferenceError(f"{name}.json key '{den}' is 0: no ratio")
    return _number(values[0] / values[1], kwargs.get("fmt"), 1, f"{name}.json ratio"), name


#: the results file that holds every benchmark's verdicts (``benchmarks/harness/bench_all.py`` writes it)
SUMMARY = "bench_all"


def _verdict(results: Results, args: list[Any], kwargs: dict[str, Any]) -> tuple[str, str]:
    """A ``verdict(benchmark, what)`` reference's text: that target's verdict in ``bench_all.json``."""
    if len(args) != 2 or kwargs:
        raise ResultReferenceError("verdict() takes a benchmark name and the start of its target's description")
    benchmark, what = (str(a).removesuffix(".json") for a in args)
    rows = results.lookup(SUMMARY, "verdicts")
    own = [r for r in rows if isinstance(r, Mapping) and r.get("benchmark") == benchmark]
    if not own:
        there = sorted({str(r.get("benchmark")) for r in rows if isinstance(r, Mapping)})
        raise ResultReferenceError(f"{SUMMARY}.json has no verdicts of '{benchmark}' (it has: {', '.join(there)})")
    found = [r for r in own if str(r.get("what", "")).startswith(what)]
    if len(found) != 1:
        listed = "; ".join(str(r.get("what")) for r in (found or own))
        problem = "matches no target" if not found else f"matches {len(found)} targets"
        raise ResultReferenceError(f"'{what}' {problem} of '{benchmark}' in {SUMMARY}.json: {listed}")
    results.load(benchmark)  # the page's provenance note names the benchmark's own file too
    return str(found[0]["verdict"]), benchmark


def _provenance_line(results: Results, name: str) -> str:
    prov = results.provenance(name)
    return f"`{name}.json`: " + ", ".join(f"{k} {v}" for k, v in prov.items())


def render(markdown: str, results: Results) -> Rendered:
    """Replace every reference in ``markdown``; errors are collected, each reference left as it was."""
    out = Rendered(markdown)

    def replace(match: re.Match[str]) -> str:
        if match["code"]:
            return match[0]
        try:
            args, kwargs = _parse(match["args"])
            if match["call"] == "provenance":
                if len(args) != 1 or kwargs:
                    raise ResultReferenceError("provenance() takes one results file name")
                text, name = f"({_provenance_line(results, args[0])})", str(args[0])
            elif match["call"] == "ratio":
                text, name = _ratio(results, args, kwargs)
            elif match["call"] == "verdict":
                text, name = _verdict(results, args, kwargs)
                if SUMMARY not in out.used:
                    out.used.append(SUMMARY)
            else:
                text, name = _figure(results, args, kwargs)
        except ResultReferenceError as exc:
            out.errors.append(f"{match[0]}: {exc}")
            return match[0]
        name = name.removesuffix(".json")
        if name not in out.used:
            out.used.append(name)
        return text

    out.markdown = _PATTERN.sub(replace, markdown)
    return out


def provenance_note(results: Results, names: Sequence[str]) -> str:
    """The closing note of a page that read ``names``: one table row per results file."""
    rows = [
        "| results | " + " | ".join(PROVENANCE_FIELDS) + " |",
        "|---|" + "---|" * len(PROVENANCE_FIELDS),
    ]
    for name in names:
        prov = results.provenance(name)
        rows.append(f"| `{name}.json` | " + " | ".join(prov[k] for k in PROVENANCE_FIELDS) + " |")
    body = "\n".join("    " + r for r in rows)
    return (
        '\n\n!!! info "Where the figures on this page come from"\n'
        "    Read from `benchmarks/results/` when this site was built; a median is followed by the [min - max] of its"
        " runs. A field the results file does not record shows as unrecorded.\n\n" + body + "\n"
    )


def _folder(config: MkDocsConfig) -> Path:
    """``extra.results_dir`` in mkdocs.yml (relative to it), else the repository's ``benchmarks/results``."""
    configured = (config.extra or {}).get("results_dir")
    if not configured:
        return RESULTS
    return (Path(config.config_file_path).resolve().parent / configured).resolve()


def references(markdown: str) -> list[str]:
    """Every result or provenance reference outside code, as written."""
    return [m[0] for m in _PATTERN.finditer(markdown) if m["call"]]


def _page_name(page: Page, config: MkDocsConfig) -> str:
    """The page's source path as a reader finds it: relative to the folder of mkdocs.yml (``docs/gpt.md``)."""
    source = Path(page.file.abs_src_path or page.file.src_uri).resolve()
    root = Path(config.config_file_path).resolve().parent
    return source.relative_to(root).as_posix() if source.is_relative_to(root) else page.file.src_uri


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace the page's result references with their figures and close the page with their provenance."""
    name = _page_name(page, config)
    source = Path(page.file.abs_src_path or "").resolve()
    if page.file.abs_src_path and not source.is_relative_to(Path(config.docs_dir).resolve()) and references(markdown):
        log.warning(
            "%s is read on GitHub as it is, so it cannot read figures from the results (%s): move the figures to a"
            " docs page and link to it",
            name,
            ", ".join(references(markdown)),
        )
        return markdown
    results = Results(_folder(config))
    rendered = render(markdown, results)
    for error in rendered.errors:
        log.warning("%s: %s", name, error)
    if not rendered.used:
        return rendered.markdown
    return rendered.markdown.rstrip("\n") + provenance_note(results, rendered.used)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """The README is not part of the site but lives beside it: a reference there would show raw on GitHub."""
    readme = Path(config.config_file_path).resolve().parent / "README.md"
    if readme.is_file() and references(readme.read_text(encoding="utf-8")):
        log.warning("README.md reads figures from the results, but GitHub shows it as it is: link to the docs instead")
    return files
