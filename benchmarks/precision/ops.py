"""Where a GPT step's CPU time goes, op by op, in fp32 and under bf16 autocast (``torch.profiler``; README.md).

python -m benchmarks.precision.ops [--repeats 3] [--steps 5] [--top 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import RESULTS, markdown_table, write_markdown
from ds_lightning.demos import GPT

PRECISIONS = ("fp32", "bf16")


def _profile(bf16: bool, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step, by op, of a fresh GPT after 3 warm-up steps."""
    torch.manual_seed(0)
    model = GPT()
    optimizer = model.configure_optimizers()
    x = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model.pipeline_loss(model.net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: e.self_cpu_time_total / steps / 1000 for e in prof.key_averages()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder (benchmarks/results)")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in PRECISIONS}
    for _ in range(opts.repeats):  # interleaved: fp32, bf16, fp32, bf16, ...
        for precision in PRECISIONS:
            runs[precision].append(_profile(precision == "bf16", opts.steps))
    ops = sorted({op for rs in runs.values() for r in rs for op in r})
    median = {p: {op: statistics.median(r.get(op, 0.0) for r in runs[p]) for op in ops} for p in PRECISIONS}
    top = sorted(ops, key=lambda op: -max(median[p][op] for p in PRECISIONS))[: opts.top]
    rows = []
    for op in top:
        a, b = median["fp32"][op], median["bf16"][op]
        rows.append([f"`{op}`", f"{a:.2f}", f"{b:.2f}", f"{b - a:+.2f}"])
    a, b = (statistics.median(sum(r.values()) for r in runs[p]) for p in PRECISIONS)
    head = [
        "# Where a GPT step's CPU time goes: fp32 against bf16 autocast",
        "",
        f"`benchmarks/precision/ops.py`: one process, 1 thread, {torch.__version__}, the demo GPT (0.9M parameters),"
        f" batch 8 x 128 tokens, AdamW; {opts.steps} profiled steps per run after 3 warm-up steps, {opts.repeats}"
        " interleaved repeats; self CPU time per step (torch.profiler, which adds its own overhead to every op),"
        " median over repeats.",
        "",
    ]
    table = markdown_table(["op", "fp32 (ms/step)", "bf16 (ms/step)", "bf16 - fp32"], rows)
    path = opts.out / "precision_gpt_ops.md"
    write_markdown(path, [*head, *table, f"| **every op** | **{a:.1f}** | **{b:.1f}** | **{b - a:+.1f}** |"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
