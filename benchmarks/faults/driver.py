"""What does ``BackupAndRestore`` cost while training runs, and how fast does a killed run come back?

Part 1, overhead: ``ds_mirrored`` on 2 CPU processes (gloo, 1 thread each), the digits MLP 64-1024-1024-10 (1.1M
parameters) and a wide 64-2240-2240-2240-10 MLP on the same data (10.2M parameters), batch 32 per process, SGD with
momentum; backups every 10 / 50 steps, ``async_save`` off (sync) and on (async), against no backup. Step time is
rank 0's step end to step end, averaged over the timed steps (``--steps``, or one backup period if longer; the mean,
not the median: the median would skip the steps that back up), so whatever a backup blocks is in it wherever the
callback runs. Target (issue 14): backups every
50 steps with ``async_save`` cost at most 5% of step time.

Part 2, recovery: under ``ds_mirrored``, ``ds_pipeline`` and ``ds_parameter_server`` (``max_staleness=0``, 1 server),
the 1.1M MLP with a backup every ``--recovery-every`` steps; rank 0 kills its whole process group with SIGKILL at a
step drawn per repeat between two backups (under ``--rank-kill`` strategies also: rank 1 kills only itself, and rank 0
must notice), and the same command runs again. Part 3, the same in the network-namespace cluster (as root), one task
per host started by TF_CONFIG alone (``netns_recovery.py``): every process of one host SIGKILLed (``Cluster.kill``) once
rank 0 has done the step, then every task started again; the host lost is ``ds_mirrored``'s second worker,
``ds_pipeline``'s second stage, and ``ds_parameter_server``'s server (a chief and a worker on two other hosts).
Recovery time is from the kill to the end of the first new training step; steps lost are the steps done before the
kill that the new run does again.

    python -m benchmarks.faults.driver [--quick] [--repeats 3] [--out DIR] [--render [JSON]] [--parts overhead recovery]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness
from benchmarks.faults import netns_recovery as cluster_recovery
from benchmarks.faults.netns_recovery import read_lines
from benchmarks.faults.report import OVERHEAD_KEYS, RECOVERY_KEYS, TARGET, TARGET_EVERY, plot, report
from benchmarks.harness import Arm, Experiment
from ds_lightning.testing import netns

WORKER = Path(__file__).resolve().parent / "worker.py"
MODELS = {"mlp1m": [1024, 1024], "mlp10m": [2240, 2240, 2240]}
STRATEGIES = ("ds_mirrored", "ds_pipeline", "ds_parameter_server")
PARTS = ("overhead", "recovery", "netns")


def overhead_arm(model: str, every: int | None, async_save: bool = True) -> str:
    """An overhead arm's name: ``mlp1m_none``, ``mlp1m_sync50``, ``mlp10m_async10``."""
    return f"{model}_none" if every is None else f"{model}_{'async' if async_save else 'sync'}{every}"


def recovery_reading(stamps: Sequence[dict[str, Any]], every: int) -> dict[str, Any]:
    """Recovery figures from rank 0's stamps over a killed launch and its re-run (see ``faults/worker.py``).

    Returns:
        ``recovery_s`` (kill to the end of the first new step) split into ``relaunch_s`` (kill to the new process's
        start; it holds ``detect_s``, the kill to rank 0's failure, when only another rank was killed),
        ``imports_s`` (torch, Lightning, ds_lightning), ``startup_s`` (the other ranks' launch, their imports and
        the rendezvous: to the ``setup`` hook), ``restore_s`` (to ``on_train_start``: the backup read and put back,
        with the strategy's model and optimizer set-up) and ``first_step_s``; the step killed at, the step resumed
        from, ``steps_lost`` (done twice) and ``since_backup`` (steps since the last multiple of ``every``, what an
        instant, complete backup would lose).

    Raises:
        ValueError: the stamps hold no kill, or no step after it.

    """
    kill = next((s for s in stamps if s["event"] == "kill"), None)
    if kill is None:
        raise ValueError("no kill in the stamps: the first launch ended on its own (is kill_at past max_steps?)")
    # The survivors of a one-rank kill may stamp a failure (or even a step) after it; the re-run is the first new
    # process to start after the kill, and its own events.
    failed = next((s for s in stamps if s["event"] == "failed" and s["t"] >= kill["t"]), None)
    start = next((s for s in stamps if s["event"] == "process_start" and s["t_process"] > kill["t"]), None)
    after = [s for s in stamps if start is not None and s["pid"] == start["pid"] and s["t"] >= start["t"]]
    fit = next((s for s in after if s["event"] == "setup"), None)
    train = next((s for s in after if s["event"] == "train_start"), None)
    step = next((s for s in after if s["event"] == "step"), None)
    if start is None or fit is None or train is None or step is None:
        raise ValueError(f"the re-run after the kill at step {kill['step']} never reached a training step")
    # The last step the killed run completed (a survivor may finish the step the kill interrupted elsewhere).
    done = max([kill["step"]] + [s["step"] for s in stamps if s["event"] == "step" and s["t"] < start["t_process"]])
    return {
        "recovery_s": step["t"] - kill["t"],
        "detect_s": failed["t"] - kill["t"] if failed else None,
        "relaunch_s": start["t_process"] - kill["t"],
        "imports_s": start["t_imported"] - start["t_process"],
        "startup_s": fit["t"] - start["t_imported"],
        "restore_s": train["t"] - fit["t"],
        "first_step_s": step["t"] - train["t"],
        "kill_step": kill["step"],
        "resumed_step": train["step"],
        "steps_lost": done - train["step"],
        "since_backup": kill["step"] % every,
    }


class Faults(harness.Benchmark):
    name = "faults"
    description = __doc__
    defaults = {
        "repeats": 3,  # a verdict rests on 3 launches per arm; about 20 minutes on a quiet 2-core machine
        "steps": 100,
        "warmup": 10,
        "every": [10, 50],
        "recovery_every": 20,
        "recovery_steps": 80,
    }
    quick = {"repeats": 1, "steps": 20, "warmup": 2, "every": [10], "recovery_every": 5, "recovery_steps": 20}

    def options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--parts",
            nargs="+",
            default=list(PARTS),
            choices=list(PARTS),
            help="overhead, recovery on loopback, recovery in the network-namespace cluster (as root; all three)",
        )
        parser.add_argument(
            "--steps",
            type=int,
            default=None,
            help="timed steps per overhead run, at least one backup period (100; 20 quick)",
        )
        parser.add_argument("--warmup", type=int, default=None, help="steps left out before them (10; 2 quick)")
        parser.add_argument("--every", type=int, nargs="+", default=None, help="backup periods (10 50; 10 quick)")
        parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
        parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
        parser.add_argument(
            "--rank-kill",
            nargs="*",
            default=["ds_mirrored"],
            choices=list(STRATEGIES),
            help="strategies also run with only rank 1 killed (ds_mirrored)",
        )
        parser.add_argument("--recovery-every", type=int, default=None, help="backup period in part 2 (20; 5 quick)")
        parser.add_argument("--recovery-steps", type=int, default=None, help="max_steps in part 2 (80; 20 quick)")
        parser.add_argument("--batch-size", type=int, default=32, help="batch per process (32)")
        parser.add_argument("--backup-root", default=None, help="where backup folders go (default: the temp folder)")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take (600)")
        parser.add_argument("--dist-timeout", type=float, default=120.0, help="seconds per collective (120)")

    def meta(self, opts: argparse.Namespace) -> dict[str, Any]:
        root = opts.backup_root or tempfile.gettempdir()
        return {
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "backup_root": root,
            "loadavg_start": os.getloadavg(),
        }

    def experiment(self, opts: argparse.Namespace) -> Experiment:
        arms = []
        if "overhead" in opts.parts:
            for model in opts.models:
                arms.append(Arm(overhead_arm(model, None), {"part": "overhead", "model": model, "backup": None}))
                for every in opts.every:
                    for async_save in (False, True):
                        backup = {"every": every, "async": async_save}
                        arms.append(
                            Arm(
                                overhead_arm(model, every, async_save),
                                {"part": "overhead", "model": model, "backup": backup},
                            )
                        )
        if "recovery" in opts.parts:
            for s in opts.strategies:
                arms.append(Arm(f"recover_{s}", {"part": "recovery", "strategy": s, "kill_rank": None}, s))
                if s in opts.rank_kill:
                    params = {"part": "recovery", "strategy": s, "kill_rank": 1}
                    arms.append(Arm(f"recover_{s}_rank1", params, f"{s}, rank 1 only"))
        if "netns" in opts.parts:
            for s in opts.strategies:
                params = {"part": "recovery", "strategy": s, "netns": True}
                arms.append(Arm(f"recover_{s}_netns", params, cluster_recovery.LAYOUTS[s].label))
        return Experiment(arms, opts.repeats)

    def _spec(self, opts: argparse.Namespace, **kw: Any) -> dict[str, Any]:
        return {"batch_size": opts.batch_size, "seed": 0, "dist_timeout": opts.dist_timeout, **kw}

    def run(self, arm: Arm, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="ds-faults-", dir=opts.backup_root) as tmp:
            if arm.params["part"] == "overhead":
                return self._overhead(arm, opts, tmp)
            if arm.params.get("netns"):
                return self._recovery_netns(arm, repeat, opts, tmp)
            return self._recovery(arm, repeat, opts, tmp)

    def _overhead(self, arm: Arm, opts: argparse.Namespace, tmp: str) -> dict[str, Any]:
        spec = self._spec(
            opts,
            strategy="ds_mirrored",
            hidden=MODELS[arm.params["model"]],
            max_steps=opts.warmup + _timed_steps(opts.steps, arm.params["backup"]) + 1,  # intervals + 1 step ends
            warmup=opts.warmup,
            backup=arm.params["backup"],
            backup_dir=tmp,
        )
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, harness.worker_env(1))
        r = found["result"]
        return {
            "rc": found["rc"],
            "params": r["params"],
            "backups": len(r["backups"]),
            # Within one run, the backups lift the mean over the median (the usual step): a figure that load drifting
            # between runs does not move, unlike the run-to-run ratio.
            "mean_over_median": r["mean_step_ms"] / r["median_step_ms"],
            **{k: r.get(k) for k in ("mean_step_ms", "median_step_ms", "max_step_ms", "save_ms", "write_ms")},
        }

    def _recovery(self, arm: Arm, repeat: int, opts: argparse.Namespace, tmp: str) -> dict[str, Any]:
        every = opts.recovery_every
        kill_at = self._kill_at(repeat, opts)
        stamp_dir = Path(tmp, "stamps")
        stamp_dir.mkdir()
        spec = self._spec(
            opts,
            strategy=arm.params["strategy"],
            hidden=MODELS["mlp1m"],
            max_steps=opts.recovery_steps,
            backup={"every": every, "async": True},
            backup_dir=str(Path(tmp, "backups")),
            stamp_dir=str(stamp_dir),
            kill_at=kill_at,
            kill_rank=arm.params["kill_rank"],
        )
        env = harness.worker_env(1)
        try:
            harness.launch(WORKER, spec, opts.timeout, env)
        except harness.Failed as exc:  # expected: killed (-9), or rank 0 failed on the killed rank's absence
            if not (stamp_dir / "killed").exists():
                raise
            first_rc = exc.found.get("rc")
        else:
            raise harness.Failed(f"the first launch was not killed, or survived the kill (kill_at={kill_at})")
        found, _, _ = harness.launch(WORKER, spec, opts.timeout, env)
        stamps = read_lines(stamp_dir / "stamps.jsonl")
        r = found["result"]
        return {
            "rc": found["rc"],
            "first_rc": first_rc,
            "last_step": r["last_step"],
            **recovery_reading(stamps, every),
        }

    def progress(self, record: dict[str, Any]) -> str:
        if "recovery_s" in record:
            return f"recovered in {record['recovery_s']:.1f} s, {record['steps_lost']} steps lost"
        return f"{record['mean_step_ms']:.2f} ms/step (mean)"

    def _kill_at(self, repeat: int, opts: argparse.Namespace) -> int:
        every = opts.recovery_every
        # Between the second and third backup, drawn per repeat (the same draw for every strategy).
        kill_at = random.Random(repeat).randint(2 * every + 1, 3 * every - 1)
        if kill_at >= opts.recovery_steps:
            raise harness.Failed(f"kill step {kill_at} >= --recovery-steps {opts.recovery_steps}: raise it")
        return kill_at

    def _recovery_netns(self, arm: Arm, repeat: int, opts: argparse.Namespace, tmp: str) -> dict[str, Any]:
        if self._cluster is None:
            raise harness.Failed(f"no network-namespace cluster: {self._netns_missing}")
        kill_at = self._kill_at(repeat, opts)
        stamp_dir = Path(tmp, "stamps")
        stamp_dir.mkdir()
        spec = self._spec(
            opts,
            strategy=arm.params["strategy"],
            hidden=MODELS["mlp1m"],
            max_steps=opts.recovery_steps,
            backup={"every": opts.recovery_every, "async": True},
            backup_dir=str(Path(tmp, "backups")),
            stamp_dir=str(stamp_dir),
            devices=1,
        )
        layout = cluster_recovery.LAYOUTS[arm.params["strategy"]]
        found = cluster_recovery.recover(self._cluster, layout, WORKER, spec, tmp, kill_at, opts.timeout)
        return {**found, **recovery_reading(read_lines(stamp_dir / "stamps.jsonl"), opts.recovery_every)}

    def collect(self, opts: argparse.Namespace) -> dict[str, Any]:
        self._cluster: netns.Cluster | None = None
        self._netns_missing = netns.missing_requirements() if "netns" in opts.parts else None
        with contextlib.ExitStack() as stack:
            if "netns" in opts.parts and self._netns_missing is None:
                self._cluster = stack.enter_context(netns.Cluster(cluster_recovery.HOSTS))
            data = super().collect(opts)
        data["loadavg_end"] = os.getloadavg()
        data["arm_params"] = {a.name: a.params for a in self.experiment(opts).arms}
        return data

    def summarise(self, data: dict[str, Any]) -> dict[str, Any]:
        records, params = data["records"], data["arm_params"]
        over = [a for a in data["arms"] if params[a]["part"] == "overhead"]
        rec = [a for a in data["arms"] if params[a]["part"] == "recovery"]
        s = harness.summarise(records, over, OVERHEAD_KEYS)
        for arm in over:
            p = params[arm]
            if p["backup"] is None:
                continue
            base, every = overhead_arm(p["model"], None), p["backup"]["every"]
            s[arm]["overhead_ratio"] = harness.paired(records, arm, base, "mean_step_ms")
            s[arm]["inrun_ratio"] = harness.paired(records, arm, base, "mean_over_median")
            s[arm]["bounds"] = _bounds(s[arm], s.get(base, {}), every, p["backup"]["async"])
            # What one backup adds to the run, amortised over its period.
            s[arm]["per_backup_ms"] = harness.paired(
                records, arm, base, "mean_step_ms", op=lambda a, b, n=every: (a - b) * n
            )
        s.update(harness.summarise(records, rec, RECOVERY_KEYS))
        target = {}
        for model in {params[a]["model"] for a in over}:
            arm = overhead_arm(model, TARGET_EVERY, True)
            ratio = s.get(arm, {}).get("overhead_ratio")
            inrun = s.get(arm, {}).get("inrun_ratio")
            target[model] = {
                "ratio": ratio,
                "met": harness.is_met(ratio, at_most=TARGET),
                "verdict": harness.verdict(ratio, at_most=TARGET),
                "inrun_ratio": inrun,
                "inrun_met": harness.is_met(inrun, at_most=TARGET),
                "inrun_verdict": harness.verdict(inrun, at_most=TARGET),
                "bounds": s.get(arm, {}).get("bounds"),
            }
        verdicts = [
            harness.judged(
                f"{what}, async backups every {TARGET_EVERY} steps, {model}", t[key], at_most=TARGET, unit="x"
            )
            for model, t in sorted(target.items())
            for key, what in (("ratio", "step time vs no backup"), ("inrun_ratio", "step time vs no backup, in-run"))
        ]
        return {"arms": s, "target": target, "verdicts": verdicts}

    def file_stem(self, settings: dict[str, Any]) -> str:
        # The overhead part re-run on its own keeps the full run's files.
        return f"{self.name}_overhead" if settings.get("parts") == ["overhead"] else super().file_stem(settings)

    def report(self, data: dict[str, Any]) -> list[str]:
        return report(data)

    def plot(self, data: dict[str, Any], out: Path) -> list[Path]:
        return plot(data, out, self.file_stem(data["settings"]))


def _timed_steps(steps: int, backup: dict[str, Any] | None) -> int:
    """Timed steps of an overhead run: ``steps``, or one whole backup period when that is longer."""
    return max(steps, backup["every"]) if backup else steps


def _bounds(arm: dict[str, Any], base: dict[str, Any], every: int, async_save: bool) -> list[float] | None:
    """The overhead ratio implied by the measured waits: ``[low, high]`` (see the report's *from timings*)."""
    if not arm.get("save_ms") or not base.get("median_step_ms"):
        return None
    period_ms = every * base["median_step_ms"]["median"]
    low = 1 + arm["save_ms"]["median"] / period_ms
    write = arm["write_ms"]["median"] if async_save and arm.get("write_ms") else 0.0
    return [low, low + write / period_ms]


if __name__ == "__main__":
    harness.main(Faults())
