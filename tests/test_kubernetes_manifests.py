"""``examples/kubernetes/``: each manifest is the kind its operator reads, and each pod's command parses as a
``ds-train`` command line (the image's ``/app/configs`` stands for ``examples/configs``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.helpers.runner import CONFIGS, REPO, worker_env

MANIFESTS = REPO / "examples" / "kubernetes"
KINDS = {
    "tfjob.yaml": ("TFJob", "tfReplicaSpecs", "tensorflow"),
    "tfjob_parameter_server.yaml": ("TFJob", "tfReplicaSpecs", "tensorflow"),
    "pytorchjob.yaml": ("PyTorchJob", "pytorchReplicaSpecs", "pytorch"),
    "trainjob.yaml": ("TrainJob", None, None),
}


def _commands(name: str) -> list[list[str]]:
    manifest = yaml.safe_load((MANIFESTS / name).read_text())
    kind, replicas, container = KINDS[name]
    assert manifest["kind"] == kind
    if replicas is None:  # TrainJob: one trainer for every node
        return [manifest["spec"]["trainer"]["command"]]
    commands = []
    for spec in manifest["spec"][replicas].values():
        (pod,) = spec["template"]["spec"]["containers"]
        assert pod["name"] == container  # the operator configures the container of this name only
        commands.append(pod["command"])
    return commands


def test_every_manifest_is_listed():
    assert sorted(p.name for p in MANIFESTS.glob("*.yaml")) == sorted(KINDS)


@pytest.mark.multiprocess
def test_every_pod_command_parses_as_ds_train():
    calls = []
    for name in KINDS:
        for command in _commands(name):
            launcher = ["torchrun", "-m", "ds_lightning.cli"] if command[0] == "torchrun" else ["ds-train"]
            assert command[: len(launcher)] == launcher, (name, command)
            args = [a.replace("/app/configs/", f"{CONFIGS}/") for a in command[len(launcher) :]]
            calls.append([*args, "--print_config"])
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.cli_calls", json.dumps(calls)],
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    parts = ("\n" + proc.stdout).split("\n=== ")[1:]
    assert len(parts) == len(calls), proc.stdout[-3000:] + proc.stderr[-3000:]
    for call, part in zip(calls, parts, strict=True):
        body, _, code = part.rpartition("--- exit ")
        assert code.strip() == "0", (call, body[-2000:])
        # One process per pod (or per torchrun worker): jsonargparse keeps the command line's value as text.
        assert "trainer:" in body and "devices: '1'" in body, (call, body[-2000:])
