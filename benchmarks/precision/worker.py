"""One precision-benchmark run: the spec's workload in one process, in fp32 or under ``MixedPrecision``.

Started by ``driver.py`` with a JSON spec, a fresh process per run so that the peak RSS is this run's alone; writes
``result.json`` (step times and losses, peak memory, bytes saved for backward, auto's decision: README.md).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import workloads as _workloads
from benchmarks.harness.timing import StepTimer
from benchmarks.harness.trainer import quiet_trainer
from ds_lightning.callbacks import MixedPrecision
from ds_lightning.demos import GPT, DigitsClassifier, DigitsDataModule


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


_VIEWS = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "ExpandBackward0", "AliasBackward0"}


def is_weight_copy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is (a view of) autocast's low-precision copy of a parameter: a cast straight from a leaf."""
    fn = tensor.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "ToCopyBackward0":
            return any(n is not None and type(n).__name__ == "AccumulateGrad" for n, _ in fn.next_functions)
        if name not in _VIEWS:
            return False
        fn = fn.next_functions[0][0]
    return False


class SavedBytesCounter(pl.LightningModule):
    """Counts the bytes a ``training_step`` saves for backward (each storage once); mixed in before the model class.

    Parameters are left out (fp32 keeps them anyway); autocast's low-precision copies of the weights, which fp32 does
    not need, are counted apart from the activations.
    """

    activation_bytes: list[int]
    weight_copy_bytes: list[int]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Runs after the callbacks' hook, in which MixedPrecision("auto") times its passes through training_step:
        # keep one entry per finished step, the step's own.
        steps = self.trainer.fit_loop.epoch_loop.batch_progress.total.completed
        del self.activation_bytes[steps:], self.weight_copy_bytes[steps:]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        params = {p.untyped_storage().data_ptr() for p in self.parameters()}
        activations: dict[int, int] = {}
        copies: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                (copies if is_weight_copy(tensor) else activations)[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = super().training_step(batch, batch_idx)
        self.activation_bytes.append(sum(activations.values()))
        self.weight_copy_bytes.append(sum(copies.values()))
        return loss


class CountingClassifier(SavedBytesCounter, DigitsClassifier):
    pass


class CountingGPT(SavedBytesCounter, GPT):
    pass


def model_and_data(spec: dict[str, Any]) -> tuple[SavedBytesCounter, Dataset]:
    workload = spec["workload"]
    if workload["model"] == "digits":
        data = DigitsDataModule(batch_size=spec["batch_size"], seed=0)
        data.setup("fit")
        assert data.train_set is not None
        return CountingClassifier(hidden_sizes=spec["hidden"], lr=spec["lr"]), data.train_set
    train_set = _workloads.build(workload).train_set
    torch.manual_seed(0)  # every arm starts from the same parameters
    shape = {k: v for k, v in workload.items() if k in _workloads.GPT_DEFAULTS}
    return CountingGPT(**shape), train_set


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    pl.seed_everything(0, verbose=False)
    cuda = spec["accelerator"] == "cuda"
    model, train_set = model_and_data(spec)
    loader = DataLoader(train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=True)
    model.activation_bytes, model.weight_copy_bytes = [], []
    timer = StepTimer(warmup=spec["warmup"])
    callbacks: list[Callback] = [timer]
    if spec["precision"] != "fp32":
        callbacks.append(MixedPrecision(spec["precision"]))
    trainer = quiet_trainer(
        accelerator=spec["accelerator"],
        devices=1,
        max_steps=spec["warmup"] + spec["steps"],
        callbacks=callbacks,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_before = peak_rss_bytes()
    trainer.fit(model, train_dataloaders=loader)
    rss_after = peak_rss_bytes()
    amp = next((c for c in callbacks if isinstance(c, MixedPrecision)), None)
    out: dict[str, Any] = {
        **timer.reading(),
        "chosen": amp.chosen if amp is not None else "fp32",
        # auto's measuring, paid once inside the first (warm-up) step: its figures and how long it took
        "decision": amp.decision.as_dict() if amp is not None and amp.decision is not None else None,
        "probe_seconds": amp.probe_seconds if amp is not None else None,
        "activation_bytes": model.activation_bytes,
        "weight_copy_bytes": model.weight_copy_bytes,
        "peak_rss_after_bytes": rss_after,
        "peak_rss_delta_bytes": rss_after - rss_before,
    }
    if cuda:
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    Path(spec["out_dir"], "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
