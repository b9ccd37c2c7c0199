"""One rank of a ladder climb (``ladder.py``): the rungs' TiedGPTs in ascending order under one mode, a few steps each.

Started by :func:`benchmarks.memory.ladder.climb` with ``LOCAL_RANK`` set (Lightning then spawns nothing: every rank
is the driver's own process, in its own capped cgroup). After a rung, every rank passes a barrier and rank 0 appends the
rung to ``rungs.jsonl``; the model, trainer and optimizer are then dropped and the heap trimmed before the next rung.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness.trainer import quiet_trainer
from benchmarks.memory import meters
from benchmarks.memory.ladder import rung_shape, tied_gpt_parameters
from benchmarks.memory.modes import make_strategy
from ds_lightning.demos import TiedGPT


def tokens(block_size: int, batch: int, procs: int, steps: int) -> TensorDataset:
    """Random byte windows, enough for ``steps`` batches on every rank (the text's content is not what is measured)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (batch * procs * steps, block_size + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def rung(spec: dict[str, Any], index: int) -> dict[str, Any]:
    """Train rung ``index`` for ``spec["steps"]`` steps; this rank's figures."""
    shape = rung_shape(index, spec["block_size"])
    meters.reset_peak_rss()
    start = time.perf_counter()
    pl.seed_everything(0, verbose=False)
    model = TiedGPT(**shape)
    trainer = quiet_trainer(
        accelerator="cpu", devices=spec["procs"], strategy=make_strategy(spec["mode"]), max_steps=spec["steps"]
    )
    data = tokens(spec["block_size"], spec["batch_size"], spec["procs"], spec["steps"])
    trainer.fit(model, DataLoader(data, batch_size=spec["batch_size"], shuffle=False))
    parameters = tied_gpt_parameters(shape["d_model"], shape["n_layer"], shape["block_size"])
    dist.barrier()
    reading = {
        "rung": index,
        **shape,
        "parameters": parameters,
        "seconds": time.perf_counter() - start,
        "peak_rss_mb": meters.rss_kib("VmHWM") / 1024,
    }
    del trainer, model
    gc.collect()
    meters.malloc_trim()
    return reading


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    out = Path(spec["out_dir"], "rungs.jsonl")
    for index in spec["rungs"]:
        reading = rung(spec, index)
        peaks: list[Any] = [None] * spec["procs"]
        dist.all_gather_object(peaks, reading["peak_rss_mb"])
        if dist.get_rank() == 0:
            with out.open("a") as f:
                f.write(json.dumps({**reading, "peak_rss_mb_ranks": peaks}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
