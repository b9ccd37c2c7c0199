"""One precision-benchmark run in a fresh process (so the peak RSS is this run's alone), in fp32 or under
``MixedPrecision``; writes ``result.json``. What it measures: README.md."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from benchmarks.harness import workloads as _workloads
from benchmarks.harness.timing import StepTimer
from benchmarks.harness.trainer import quiet_trainer
from ds_lightning.callbacks import MixedPrecision
from ds_lightning.demos import GPT, DigitsClassifier, DigitsDataModule

_VIEWS = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "ExpandBackward0", "AliasBackward0"}


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


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
    Parameters are left out (fp32 keeps them anyway); autocast's weight copies are counted apart from activations."""

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


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    pl.seed_everything(0, verbose=False)
    model: SavedBytesCounter
    if spec["workload"]["model"] == "digits":
        data = DigitsDataModule(batch_size=spec["batch_size"], seed=0)
        data.setup("fit")
        model, train_set = CountingClassifier(hidden_sizes=spec["hidden"], lr=spec["lr"]), data.train_set
    else:
        train_set = _workloads.build(spec["workload"]).train_set
        torch.manual_seed(0)  # every arm starts from the same parameters
        model = CountingGPT(**{k: v for k, v in spec["workload"].items() if k in _workloads.GPT_DEFAULTS})
    loader = DataLoader(train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=True)
    model.activation_bytes, model.weight_copy_bytes = [], []
    timer = StepTimer(warmup=spec["warmup"])
    amp = MixedPrecision(spec["precision"]) if spec["precision"] != "fp32" else None
    trainer = quiet_trainer(
        accelerator=spec["accelerator"],
        devices=1,
        max_steps=spec["warmup"] + spec["steps"],
        callbacks=[timer] if amp is None else [timer, amp],
    )
    cuda = spec["accelerator"] == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_before = peak_rss_bytes()
    trainer.fit(model, train_dataloaders=loader)
    rss_after = peak_rss_bytes()
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
