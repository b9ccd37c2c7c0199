"""``ds-train diagnose DIR``: read a run's Flight Recorder dumps again, with torch's analyzer, after the fact.

torch's analyzer (``torch.distributed.flight_recorder``, the ``torchfrtrace`` command) matches every rank's calls by
process group and sequence number and reports the ranks that never joined a call and the calls that do not match
(another operation, other sizes, another dtype). Its command prints to its logger and always exits 0, and it cannot
read the dumps gloo writes as they are (:mod:`ds_lightning.diagnostics.flight_recorder` writes them readable); this
module calls the analyzer's own reading and matching, and says the result in the hang verdict's words. The verdicts
the run wrote (``verdict_rank<r>.json``: where each rank was, which the dumps do not hold) are printed after it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path
from typing import Any

from ds_lightning.diagnostics.flight_recorder import DUMP_PREFIX

__all__ = ["diagnose_folder", "main"]


def _analyzer_database(folder: Path) -> Any:
    # torch's analyzer is a set of private modules with no stability promise: imported here, used for reading and
    # matching only, so a change in them breaks this command and nothing else.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # "no tabulate"
        from torch.distributed.flight_recorder.components.builder import build_db
        from torch.distributed.flight_recorder.components.config_manager import JobConfig
        from torch.distributed.flight_recorder.components.loader import read_dir

    logging.getLogger("Flight Recorder").setLevel(logging.CRITICAL)  # the same findings, said below
    args = JobConfig().parse_args([str(folder), "--allow-incomplete-ranks", "--prefix", DUMP_PREFIX])
    details, version = read_dir(args)
    return build_db(details, args, version)


def _op(name: str) -> str:
    return name.split(":")[-1]


def diagnose_folder(folder: Path) -> list[str]:
    """The findings on the dumps in ``folder``, one line each (the analyzer's, then the run's own verdicts).

    Raises:
        FileNotFoundError: when ``folder`` holds no dump, naming what was expected.

    """
    ranks = sorted(int(p.name[len(DUMP_PREFIX) :]) for p in folder.glob(f"{DUMP_PREFIX}*") if p.name[-1].isdigit())
    if not ranks:
        raise FileNotFoundError(
            f"{folder} holds no Flight Recorder dump ({DUMP_PREFIX}<rank> files). A run writes them to"
            " <default_root_dir>/flight_recorder (or DS_LIGHTNING_HANG_DIR) when a collective waits past its timeout."
        )
    lines = [f"Flight Recorder dumps of ranks {ranks} in {folder} (torch's analyzer):"]
    found = 0
    for call in _analyzer_database(folder).collectives:
        what = f"{_op(call.collective_name)} #{call.collective_seq_id} on process group '{call.pg_desc}'"
        sizes = f" (sizes {call.input_sizes})"
        if call.missing_ranks:
            found += 1
            lines.append(f"  {what}{sizes}: ranks {sorted(call.missing_ranks)} never joined it.")
        if not call.pass_check and call.mismatch_collectives:
            found += 1
            for rank, other in sorted(call.mismatch_collectives.items()):
                match = other.type_of_mismatch
                state = getattr(getattr(match, "state", None), "name", "mismatch")
                lines.append(
                    f"  {what}{sizes}: desync, rank {rank} called {_op(other.collective_name)} #"
                    f"{other.collective_seq_id} (sizes {other.input_sizes}): {state.lower().replace('_', ' ')}."
                )
    if not found:
        lines.append("  every call recorded on every rank matches: no missing rank, no desync.")
    for verdict in sorted(folder.glob("verdict_rank*.json")):
        data = json.loads(verdict.read_text())
        lines.append(f"The run's own verdict ({verdict.name}):")
        lines += [f"  {line}" for line in data.get("message", "").splitlines()]
    return lines


def main(folder: str) -> int:
    """Print :func:`diagnose_folder`'s findings; the exit code is 2 when there is nothing to read."""
    try:
        lines = diagnose_folder(Path(folder))
    except (FileNotFoundError, AssertionError, ValueError) as error:
        print(f"ds-train diagnose: {error}")
        return 2
    print("\n".join(lines))
    return 0
