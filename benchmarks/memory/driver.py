"""What do ``ds_mirrored``'s sharding modes (ZeRO-1 on zero or fsdp2, ZeRO-3, ZeRO-3 + CPU offload) save and cost
against plain ``ds_mirrored``, beside Lightning's FSDPStrategy and DeepSpeedStrategy; how large a TiedGPT trains under a
per-process memory cap; what a sharded checkpoint save costs against a full one. Arms, targets and a full run's
length: ``README.md``.

    python -m benchmarks.memory.driver [--quick] [--model digits|gpt] [--procs 2 4] [--modes ...] [--parts ...] ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.harness import Arm, Experiment
from benchmarks.memory import cgroup, report
from benchmarks.memory.ladder import RUNGS, climb
from benchmarks.memory.modes import EXTERNAL, MIRRORED, MODES, arm_name, arm_title, mode_of
from benchmarks.memory.readings import CHECKPOINT_KEYS, ladder_reading, mode_reading
from benchmarks.sharding_engines import common
from benchmarks.sharding_engines.common import BYTES_TARGET, STATE_TARGETS, STEP_TARGET

HERE = Path(__file__).resolve().parent
WORKER, LADDER_WORKER = HERE / "worker.py", HERE / "ladder_worker.py"
SUMMARY_KEYS = ["step_ms", "state_mb_max", "state_mb_min", "grad_mb", "broadcast_mb_max", "fsdp_mb_max"]
SUMMARY_KEYS += ["sent_mb_max", "ring_mb_max", "rss_mb_max", "param_mb_max", "grad_local_mb_max"]
SUMMARY_KEYS += ["model_state_mb_max", "activation_mb_max"]
CHECKPOINT_SUMMARY_KEYS = ["ckpt_model_mb", "step_ms", "rss_mb_max"]
CHECKPOINT_SUMMARY_KEYS += [f"ckpt_{kind}_{k}" for kind in ("sharded", "full") for k in CHECKPOINT_KEYS]
LADDER_KEYS = ["largest_parameters", "largest_mparams", "largest_peak_rss_mb", "rungs_finished", "climb_s"]
ZERO3_STATE_TARGET = 0.30  # ZeRO-3's model state against plain's, at 4 ranks
LADDER_TARGET = 3.0  # the largest TiedGPT under the cap, ZeRO-3 against plain, at 4 ranks
CHECKPOINT_TARGET = 1.10  # rank 0's growth during a sharded save, over 1/N of the model
PARTS = ("modes", "ladder", "checkpoint")
#: The checkpoint part's larger model (ZeRO-3): a fixed cost of the save is then small beside 1/N of the model.
CHECKPOINT_HIDDEN = [4096, 4096]  # the digits MLP: 17.1M parameters
CHECKPOINT_GPT = {"n_layer": 8, "n_head": 8, "d_model": 512}  # TiedGPT: 25.4M parameters
JUDGED = ("plain", "zero3")  # the ladder's judged pair
CAP_MB = 500  # the ladder's per-process cap (MiB)
GPT_STEPS = 6  # timed GPT steps per launch (the sharding benchmark's 10 made a full run too long with 5 modes)
#: the optional DeepSpeed install ``make bench-memory`` makes (``pip install --target``), put on the arm's path
EXTRA_PATH = harness.REPO / ".venv" / "bench-extra"


def ladder_arm(mode: str, procs: int) -> str:
    return f"ladder_{arm_name(mode, procs)}"


def checkpoint_arm(procs: int) -> str:
    return f"checkpoint_{arm_name('zero3', procs)}"


def targets(summary: dict[str, Any], procs: list[int], modes: list[str]) -> list[dict[str, Any]]:
    """Every target's ratio (mode / plain per repeat) and verdict, per mode and process count."""
    out = []
    for mode in [m for m in modes if m != "plain"]:
        prefix = "" if mode == "zero" else f"{MODES[mode].key}: "
        for n in procs:
            arm = summary.get(arm_name(mode, n), {})
            if not arm.get("first"):  # never ran (Lightning's own strategies here): the page says why instead
                continue
            state = STATE_TARGETS.get(n) if mode in ("zero", "fsdp2") else None
            step = STEP_TARGET if mode in ("zero", "fsdp2") else None
            payload = BYTES_TARGET if mode in ("zero", "fsdp2") else None
            cap = ZERO3_STATE_TARGET if mode == "zero3" and n == 4 else None
            checks: list[tuple[str, str, float | None]] = [
                (f"{prefix}optimizer-state bytes, largest rank", "state_mb_max", state),
                (f"{prefix}model state (params + grads + optimizer state), largest rank", "model_state_mb_max", cap),
                (f"{prefix}step time (rank 0's median)", "step_ms", step),
                (f"{prefix}peak RSS, largest rank (no target)", "rss_mb_max", None),
            ]
            if not MODES[mode].external:
                checks += [
                    (f"{prefix}payload bytes per step (counted), largest rank", "sent_mb_max", payload),
                    (f"{prefix}payload bytes under a ring model, largest rank", "ring_mb_max", payload),
                ]
            out += common.judged(arm, n, checks)
    return out


def extra_verdicts(summary: dict[str, Any], st: dict[str, Any]) -> list[dict[str, Any]]:
    """The ladder's and the checkpoint's targets, as ``summary["verdicts"]`` lists them."""
    out = []
    for n in st.get("ladder_procs", []) if "ladder" in st["parts"] else []:
        ratio = summary.get("ladder", {}).get(ladder_arm("zero3", n), {}).get("largest_parameters_ratio")
        what = f"ZeRO-3: largest TiedGPT under the {st['cap_mb']} MiB cap / plain's (parameters), {n} processes"
        out.append(harness.judged(what, ratio, at_least=LADDER_TARGET, unit="x"))
    for n in st["procs"] if "checkpoint" in st["parts"] else []:
        ratio = summary.get("checkpoint", {}).get(checkpoint_arm(n), {}).get("ckpt_sharded_growth_ratio")
        what = f"rank 0's resident growth during a sharded save / (model / N), {n} processes"
        out.append(harness.judged(what, ratio, at_most=CHECKPOINT_TARGET, unit="x"))
    return out


class Memory(common.ShardingBenchmark):
    name = "memory"
    description = __doc__
    worker = WORKER
    title = "Sharding modes"
    summary_keys = SUMMARY_KEYS
    ratio_keys: tuple[str, ...] = ("step_ms", "state_mb_max", "sent_mb_max", "ring_mb_max", "rss_mb_max")
    ratio_keys += ("model_state_mb_max", "activation_mb_max")
    defaults = {"repeats": 3}
    quick = {"repeats": 1}

    def __init__(self) -> None:
        self.first_error: dict[str, str] = {}

    def options(self, parser: argparse.ArgumentParser) -> None:
        super().options(parser)
        parser.add_argument("--modes", nargs="+", choices=MIRRORED, default=None, help=f"({' '.join(MIRRORED)})")
        parser.add_argument("--external", nargs="*", choices=EXTERNAL, default=None, help=f"({' '.join(EXTERNAL)})")
        parser.add_argument(
            "--parts", nargs="+", choices=PARTS, default=None, help="(modes checkpoint; ladder too with --model gpt)"
        )
        parser.add_argument("--no-checkpoint", dest="checkpoint", action="store_false", help="no checkpoint part")
        parser.add_argument("--cap-mb", type=int, default=CAP_MB, help=f"the ladder's per-process cap, MiB ({CAP_MB})")
        parser.add_argument("--ladder-procs", type=int, nargs="+", default=[4], help="the ladder's ranks (4)")
        parser.add_argument("--ladder-modes", nargs="+", choices=MIRRORED, default=None, help="(every mode)")
        parser.add_argument("--ladder-block", type=int, default=64, help="the ladder's context (64 tokens)")
        parser.add_argument("--ladder-steps", type=int, default=2, help="steps per rung (2, batch 1 per rank)")
        parser.add_argument("--ladder-start", type=int, default=4, help="the first rung climbed (4: 5.0M parameters)")
        parser.add_argument(
            "--ladder-repeats", type=int, default=None, help="climbs of plain and ZeRO-3 (full run 3); other modes 1"
        )
        parser.add_argument(
            "--mmap-threshold",
            type=int,
            default=65536,
            help="MALLOC_MMAP_THRESHOLD_ of every launch (65536; 0: glibc's dynamic default)",
        )
        parser.add_argument("--extra-path", default=str(EXTRA_PATH), help="where the optional deepspeed is installed")

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        if opts.model == "gpt" and not opts.quick and getattr(opts, "steps", None) is None:
            opts.steps = GPT_STEPS
        out = super().meta(opts)
        quick_modes = ["plain", "zero3"]  # a smoke test: the baseline and the mode every new part runs
        opts.modes = opts.modes or (quick_modes if opts.quick else list(MIRRORED))
        opts.extra_path = str(Path(opts.extra_path).resolve())  # the ranks run in a temporary folder
        opts.external = ([] if opts.quick else list(EXTERNAL)) if opts.external is None else opts.external
        opts.parts = opts.parts or [p for p in PARTS if p != "ladder" or opts.model == "gpt"]
        opts.parts = [p for p in opts.parts if p != "checkpoint" or opts.checkpoint]
        opts.ladder_modes = opts.ladder_modes or (quick_modes if opts.quick else list(MIRRORED))
        opts.ladder_repeats = opts.ladder_repeats or opts.repeats
        if opts.quick:  # a smoke test: 2 processes, and one step a rung
            opts.procs = [2] if opts.procs == [2, 4] else opts.procs
            opts.ladder_steps = 1
        if "plain" not in opts.modes or "plain" not in opts.ladder_modes:
            raise SystemExit("--modes and --ladder-modes need plain: every ratio is against it")
        out["cgroup_unavailable"] = cgroup.unavailable_reason() if "ladder" in opts.parts else None
        return out

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = [
            Arm(arm_name(m, n), {"procs": n, "mode": m}, arm_title(m, n))
            for n in opts.procs
            for m in [*opts.modes, *opts.external]
        ]
        return Experiment(arms, opts.repeats)

    def ladder_experiments(self, opts: argparse.Namespace) -> list[Experiment]:
        """The judged pair (plain, ZeRO-3) climbed ``--ladder-repeats`` times interleaved, then the other modes once."""

        def arms(modes: list[str]) -> list[Arm]:
            title = "{}, {} procs"
            return [
                Arm(ladder_arm(m, n), {"procs": n, "mode": m}, title.format(MODES[m].title, n))
                for n in opts.ladder_procs
                for m in modes
            ]

        judged = [m for m in opts.ladder_modes if m in JUDGED]
        others = [m for m in opts.ladder_modes if m not in JUDGED]
        return [Experiment(arms(judged), opts.ladder_repeats), *([Experiment(arms(others), 1)] if others else [])]

    def checkpoint_experiment(self, opts: argparse.Namespace) -> Experiment:
        """ZeRO-3 on the larger model, one timed step, then a sharded and a full save, per process count."""
        params = {"mode": "zero3", "checkpoint": True, "larger": True}
        title = "ZeRO-3, larger model, {} procs"
        return Experiment(
            [Arm(checkpoint_arm(n), {**params, "procs": n}, title.format(n)) for n in opts.procs], opts.repeats
        )

    def env(self, opts: argparse.Namespace, rendezvous: bool = True) -> dict[str, str]:
        """A launch's environment: one thread, and glibc's mmap threshold fixed (see the README)."""
        extra = {"MALLOC_MMAP_THRESHOLD_": str(opts.mmap_threshold)} if opts.mmap_threshold else {}
        return harness.worker_env(1, rendezvous, **extra)

    def spec(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {**super().spec(arm, repeat, opts), "extra_path": opts.extra_path}
        if arm.params.get("larger"):  # the checkpoint part: the larger model, one warm-up and one timed step
            spec.update(hidden=CHECKPOINT_HIDDEN, warmup=1, steps=1)
            if spec["workload"]["model"] == "gpt":
                spec["workload"] = {**spec["workload"], **CHECKPOINT_GPT}
        return spec

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        if arm.name in self.first_error:  # an external strategy that could not start here: once is enough
            raise harness.Failed(f"not run again: {self.first_error[arm.name]}")
        env = self.env(opts)
        if MODES[arm.params["mode"]].external == "deepspeed":
            env["PYTHONPATH"] = f"{opts.extra_path}:{env['PYTHONPATH']}"
        try:
            found, _, _ = harness.launch(self.worker, self.spec(arm, repeat, opts), opts.timeout, env)
        except harness.Failed as exc:
            if MODES[arm.params["mode"]].external:
                self.first_error[arm.name] = str(exc)
            raise
        return {"rc": found["rc"], **mode_reading(found["result"])}

    def run_ladder(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        spec = {"mode": arm.params["mode"], "rungs": list(range(opts.ladder_start, len(RUNGS)))}
        spec.update(block_size=opts.ladder_block, batch_size=1, steps=opts.ladder_steps)
        env = self.env(opts, rendezvous=False)
        found = climb(LADDER_WORKER, spec, arm.params["procs"], opts.cap_mb << 20, opts.timeout, env)
        return ladder_reading(found)

    def progress(self, record: dict[str, Any]) -> str:
        if "stopped" in record:
            top = record["largest_mparams"]
            return f"largest {top if top is None else f'{top:.1f}M'} parameters, stopped: {record['stopped']}"
        return (
            f"{record['step_ms']:.2f} ms/step, model state {record['model_state_mb_max']:.3f} MB,"
            f" RSS {record['rss_mb_max']:.0f} MB (largest rank)"
        )

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        data: dict[str, Any] = {"records": [], "arms": {}, "ladder_arms": {}, "checkpoint_arms": {}, "baseline": None}
        if "modes" in opts.parts:
            experiment = self.experiment(opts)
            data["records"] += harness.run_experiment(experiment, lambda a, r: self.run(a, r, opts), self.progress)
            data["arms"] = {a.name: a.title for a in experiment.arms}
        if "ladder" in opts.parts and cgroup.unavailable_reason() is None:
            for ladder in self.ladder_experiments(opts):
                records = harness.run_experiment(ladder, lambda a, r: self.run_ladder(a, r, opts), self.progress)
                data["records"] += [{**r, "part": "ladder"} for r in records]
                data["ladder_arms"].update({a.name: a.title for a in ladder.arms})
        elif "ladder" in opts.parts:
            print(f"  ladder skipped: {cgroup.unavailable_reason()}", flush=True)
        if "checkpoint" in opts.parts:
            saves = self.checkpoint_experiment(opts)
            records = harness.run_experiment(saves, lambda a, r: self.run(a, r, opts), self.progress)
            data["records"] += [{**r, "part": "checkpoint"} for r in records]
            data["checkpoint_arms"] = {a.name: a.title for a in saves.arms}
        return data

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        st = data["settings"]
        modes = [m for m in (*st["modes"], *st["external"])]
        procs = st["procs"]
        mode_records = [r for r in data["records"] if r.get("part") not in ("ladder", "checkpoint")]
        pairs = [(arm_name(m, n), arm_name("plain", n)) for n in procs for m in modes if m != "plain"]
        pairs = [(a, b) for a, b in pairs if a in data["arms"]]
        s = self.spreads({**data, "records": mode_records}, pairs) if data["arms"] else {}
        saves = [r for r in data["records"] if r.get("part") == "checkpoint"]
        s["checkpoint"] = harness.summarise(saves, list(data.get("checkpoint_arms", {})), CHECKPOINT_SUMMARY_KEYS)
        for arm in data.get("checkpoint_arms", {}):  # an unavailable option, or a save's error, as the arm's note
            notes = {r.get("ckpt_unavailable") for r in saves if r["arm"] == arm} - {None}
            errors = {k: r[k] for r in saves if r["arm"] == arm for k in r if k.endswith("_error")}
            s["checkpoint"][arm]["checkpoint_notes"] = sorted(notes) + [f"{k}: {v}" for k, v in sorted(errors.items())]
            first = next(iter(harness.ok(saves, arm)), None)
            s["checkpoint"][arm]["parameters"] = first.get("parameters") if first else None
        ladder_records = [r for r in data["records"] if r.get("part") == "ladder"]
        arms = list(data.get("ladder_arms", {}))
        s["ladder"] = harness.summarise(ladder_records, arms, LADDER_KEYS)
        for arm in arms:
            base = ladder_arm("plain", int(arm.rsplit("_p", 1)[1]))
            s["ladder"][arm]["largest_parameters_ratio"] = harness.paired(
                ladder_records, arm, base, "largest_parameters"
            )
            s["ladder"][arm]["climbs"] = [
                {k: r.get(k) for k in ("repeat", "largest_shape", "stopped", "stop_error", "cgroup_peak_mb")}
                for r in sorted(harness.ok(ladder_records, arm), key=lambda r: r["repeat"])
            ]
        s["targets"] = targets(s, procs, modes) if data["arms"] else []
        s["verdicts"] = [*common.verdicts(s["targets"]), *extra_verdicts(s, st)]
        return s

    def report(self, data: dict[str, Any]) -> list[str]:
        return report.page(data)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        return report.figure(data, out / f"{harness.stem(self, data['settings'].get('model'))}.png")


__all__ = ["Memory", "arm_name", "arm_title", "checkpoint_arm", "mode_of", "targets"]

if __name__ == "__main__":
    harness.main(Memory())
