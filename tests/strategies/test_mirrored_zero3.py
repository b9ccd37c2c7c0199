"""``MirroredStrategy(shard_parameters=True)``: ZeRO-3 on the fsdp2 engine, with ``cpu_offload`` and bf16 gathering.

The options and their checks run without processes. The rest are real gloo processes (``tests.helpers.zero3_runs``,
one launch per world size and suite, every rank's exit code checked) on two GPTs with a head tied to the token
embedding: ds_lightning's ``TiedGPT`` (a ``ModuleList`` of blocks) and transformers' GPT-2. Each compares with plain
ds_mirrored on the same batches, and each feature has a control that shows it off: plain's state ratio of 1.0, the
fsdp2 engine's parameters still whole after the forward, the policy a unit runs without offload, a plain arm's fp32
gather.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from jsonargparse import ArgumentParser
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.testing import assert_close

from ds_lightning.cli import main as cli_main
from ds_lightning.sharding.fsdp2 import shard_units
from ds_lightning.sharding.zero3 import fully_shard_policies, local_state_bytes, parameter_units
from ds_lightning.strategies import MirroredStrategy
from ds_lightning.strategies.capabilities import capabilities_of
from tests.helpers.backup_compose import assert_composed_run_matches_plain_and_resumes
from tests.helpers.hf_models import HFGPT2
from tests.helpers.runner import example_config, run_ranks
from tests.helpers.sharding_runs import params
from tests.helpers.zero3_runs import STEPS, TIES, hf_gpt2, tied_gpt

BOUND = {2: 0.55, 4: 0.30}  # per-rank model state, as a fraction of an unsharded replica's
INITIAL = {"tied": tied_gpt, "hf": hf_gpt2, "accum": tied_gpt, "manual": tied_gpt}  # the model each arm starts from

# --- options (no processes) ----------------------------------------------------------------------------------------


def test_shard_parameters_implies_the_fsdp2_engine_and_sharded_optimizer_state():
    strategy = MirroredStrategy(shard_parameters=True)
    assert (strategy.sharding_engine, strategy.shard_optimizer_state, strategy._fully_sharding) == ("fsdp2", True, True)
    assert not dist.is_initialized()  # constructing starts nothing
    plain = MirroredStrategy()  # control: "auto" stays the zero engine, nothing sharded
    assert (plain.sharding_engine, plain.shard_optimizer_state, plain._fully_sharding) == ("zero", False, False)
    explicit = MirroredStrategy(shard_optimizer_state=True, sharding_engine="fsdp2", shard_parameters=True)
    assert explicit.sharding_engine == "fsdp2" and explicit.shard_parameters


def test_shard_parameters_refuses_the_zero_engine():
    with pytest.raises(ValueError, match=r"shard_parameters=True .* sharding_engine='zero' .* drop sharding_engine"):
        MirroredStrategy(shard_parameters=True, sharding_engine="zero")


def test_cpu_offload_needs_shard_parameters():
    with pytest.raises(ValueError, match=r"cpu_offload=True .* set shard_parameters=True"):
        MirroredStrategy(cpu_offload=True)
    with pytest.raises(ValueError, match=r"cpu_offload=True .* set shard_parameters=True"):
        MirroredStrategy(shard_optimizer_state=True, sharding_engine="fsdp2", cpu_offload=True)
    assert MirroredStrategy(shard_parameters=True, cpu_offload=True).cpu_offload  # control: the valid pair


@pytest.mark.parametrize(("option", "value"), [("shard_parameters", "yes"), ("cpu_offload", 1)])
def test_flags_must_be_bools(option, value):
    with pytest.raises(ValueError, match=rf"{option}={value!r} must be True or False"):
        MirroredStrategy(**{"shard_parameters": True, option: value})


def test_shard_parameters_refuses_what_acts_on_ddps_all_reduce():
    with pytest.raises(
        ValueError, match=r"shard_parameters=True cannot run gradient_compression='fp16'.*FSDP2 replaces"
    ):
        MirroredStrategy(shard_parameters=True, gradient_compression="fp16")


def test_options_parse_from_the_command_line_types():
    """The constructor stays typed for LightningCLI (jsonargparse reads the signature)."""
    parser = ArgumentParser()
    parser.add_class_arguments(MirroredStrategy, "strategy")
    parsed = parser.parse_args(["--strategy.shard_parameters=true", "--strategy.cpu_offload=true"])
    assert parsed.strategy.shard_parameters is True and parsed.strategy.cpu_offload is True
    assert parsed.strategy.sharding_engine == "auto"
    with pytest.raises(SystemExit):  # not one of the Literal's values
        parser.parse_args(["--strategy.sharding_engine=fsdp"])


def _ds_train(args: list[str]) -> tuple[object, str]:
    """``ds-train args`` in this process (for calls that end before any training process starts): (exit, output)."""
    out = io.StringIO()
    try:
        # LightningCLI warns when the process's own argv (pytest's here) sits beside the args it is given.
        with contextlib.redirect_stdout(out), mock.patch.object(sys, "argv", ["ds-train"]):
            cli_main(args)
    except SystemExit as stop:
        return stop.code, out.getvalue()
    except ValueError as error:
        return error, out.getvalue()
    return 0, out.getvalue()


def test_ds_train_takes_the_options_in_both_yaml_forms(tmp_path):
    """A class_path with init_args in YAML, and the class path plus overrides on the command line, both parse to
    the typed options; the contradictory pair is refused by the constructor with its fix."""
    config = tmp_path / "zero3.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: ds_lightning.strategies.MirroredStrategy\n"
        "    init_args:\n      shard_parameters: true\n      cpu_offload: true\n"
    )
    base = ["fit", *example_config("mirrored.yaml")]
    code, printed = _ds_train([*base, f"--config={config}", "--print_config"])
    assert code == 0 and "shard_parameters: true" in printed and "cpu_offload: true" in printed, printed
    class_path = "--trainer.strategy=ds_lightning.strategies.MirroredStrategy"
    code, printed = _ds_train([*base, class_path, "--trainer.strategy.shard_parameters=true", "--print_config"])
    assert code == 0 and "shard_parameters: true" in printed and "sharding_engine: auto" in printed, printed
    refused, _ = _ds_train(
        [*base, class_path, "--trainer.strategy.shard_parameters=true", "--trainer.strategy.sharding_engine=zero"]
    )
    assert isinstance(refused, ValueError) and "drop sharding_engine" in str(refused)
    assert not dist.is_initialized()


def test_capabilities_and_the_load_balancer():
    strategy = MirroredStrategy(shard_parameters=True)
    caps = capabilities_of(strategy)
    assert caps.precision_plugin_wraps_forward and caps.agrees_over_default_group and not caps.saves_from_chief_alone
    with pytest.raises(ValueError, match=r"replaces DDP; use sharding_engine='zero'"):
        strategy.balance_batches(lambda loader: loader)


def _names(root: torch.nn.Module, units: list[torch.nn.Module]) -> list[str]:
    names = {id(m): n for n, m in root.named_modules()}
    return [names[id(u)] for u in units]


@pytest.mark.parametrize(
    ("build", "blocks", "leftover"),
    [
        (tied_gpt, ["net.blocks.0", "net.blocks.1"], ["net.position", "net.norm"]),
        (hf_gpt2, ["net.transformer.h.0", "net.transformer.h.1"], ["net.transformer.wpe", "net.transformer.ln_f"]),
    ],
)
def test_units_are_the_blocks_and_the_tied_parameter_stays_in_the_root(build, blocks, leftover):
    model = build()
    units = _names(model, parameter_units(model))
    assert set(units) == {*blocks, *leftover}
    tie = TIES["hf" if isinstance(model, HFGPT2) else "tied"]
    owners = [name.rsplit(".", 1)[0] for name in tie]
    assert model.get_parameter(tie[0]) is model.get_parameter(tie[1])
    assert not set(owners) & set(units)  # neither user of the tied parameter is a unit: the root owns it
    # Control: the optimizer-state engine's units are the one child `net`, which holds everything (gathered whole).
    assert _names(model, shard_units(model)) == ["net"]


class _TiedInside(torch.nn.Module):
    """A block whose two linear layers share one weight: both users inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight


def test_a_tie_inside_one_block_keeps_the_block_and_a_shared_block_goes_to_the_root():
    inside = torch.nn.Module()
    inside.blocks = torch.nn.ModuleList([_TiedInside(), _TiedInside()])
    assert _names(inside, parameter_units(inside)) == ["blocks.0", "blocks.1"]
    shared = torch.nn.Linear(4, 4)
    reused = torch.nn.Module()
    reused.blocks = torch.nn.ModuleList([shared, torch.nn.Linear(4, 4), shared])  # one module at two places
    assert _names(reused, parameter_units(reused)) == ["blocks.1"]  # the shared one stays in the root


def test_policies_follow_the_precision_and_the_device():
    mixed, offload = fully_shard_policies("bf16-mixed", torch.device("cpu"), cpu_offload=True)
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert isinstance(offload, CPUOffloadPolicy) and not offload.pin_memory  # pinning needs an accelerator
    assert fully_shard_policies("bf16-mixed", torch.device("cuda", 0), cpu_offload=True)[1].pin_memory
    full, none = fully_shard_policies("32-true", torch.device("cpu"), cpu_offload=False)
    assert full.param_dtype is None and type(none) is OffloadPolicy


def test_local_state_bytes_counts_a_tied_parameter_once():
    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
    model[1].weight = model[0].weight
    optimizer = torch.optim.Adam(model.parameters())
    model[1](model[0](torch.tensor([1]))).sum().backward()
    optimizer.step()
    assert local_state_bytes(model, [optimizer]) == {"parameters": 32, "gradients": 32, "optimizer_state": 68}


# --- parity, state per rank, offload (2 and 4 ranks) -------------------------------------------------------------


def launch(out: Path, suite: str, ranks: int) -> Path:
    run = run_ranks("tests.helpers.zero3_runs", [str(out), suite], ranks, timeout=240)
    run.assert_every_rank_exits(0)
    return out


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    launched: dict[int, Path] = {}

    def runs(world: int) -> Path:
        if world not in launched:
            launched[world] = launch(tmp_path_factory.mktemp(f"zero3_parity{world}"), "parity", world)
        return launched[world]

    return runs


def probe(out: Path, name: str, rank: int) -> dict:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


def assert_parity(out: Path, model: str, arm: str, world: int, tolerance: float = 1e-5) -> None:
    """``arm``'s whole final parameters and every rank's losses are plain's within ``tolerance``, and training moved
    every tensor by more than 10x the tolerance."""
    plain, sharded = params(out / f"{model}-plain", 0), params(out / f"{model}-{arm}", 0)
    assert plain["global_step"] == sharded["global_step"] == STEPS
    assert sharded["state_dict"].keys() == plain["state_dict"].keys()
    pl.seed_everything(0, verbose=False)
    initial = INITIAL[model]().state_dict()
    for name, value in plain["state_dict"].items():
        if value.is_floating_point():
            assert (value - initial[name]).abs().max() > 10 * tolerance, name
        assert_close(sharded["state_dict"][name], value, atol=tolerance, rtol=tolerance)
    for rank in range(world):
        expected = probe(out, f"{model}-plain", rank)["losses"]
        assert len(expected) == plain["batches_this_run"]  # one loss per batch (per micro-batch under accumulation)
        assert_close(probe(out, f"{model}-{arm}", rank)["losses"], expected, atol=tolerance, rtol=tolerance)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ["tied", "hf"])
def test_matches_plain_ds_mirrored(parity_runs, world, model):
    out = parity_runs(world)
    assert probe(out, f"{model}-zero3", 0)["dtensor"] and not probe(out, f"{model}-plain", 0)["dtensor"]  # sharded
    assert_parity(out, model, "zero3", world)
    first, last = TIES[model]
    for arm in ("plain", "zero3"):
        assert probe(out, f"{model}-{arm}", 0)["tied"]  # one parameter under two names, before and after sharding
        assert_close(
            params(out / f"{model}-{arm}", 0)["state_dict"][first],
            params(out / f"{model}-{arm}", 0)["state_dict"][last],
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ["tied", "hf"])
def test_each_rank_holds_its_share_of_the_model_state(parity_runs, world, model):
    """Parameters + gradients + optimizer state read from each rank's local tensors after the last step, against an
    unsharded replica's. Every tensor has a multiple of 4 rows, so each rank holds 1/N plus Adam's step counts."""
    out = parity_runs(world)
    for rank in range(world):
        seen = probe(out, f"{model}-zero3", rank)
        ratio = sum(seen["state_bytes"].values()) / seen["whole_bytes"]
        assert seen["dtensor"] and ratio <= BOUND[world], (rank, ratio, seen["state_bytes"])
        print(f"{model} at {world} ranks, rank {rank}: state ratio {ratio:.4f} (bound {BOUND[world]})")
        plain = probe(out, f"{model}-plain", rank)  # control: a replica holds all of it, and fails the bound
        plain_ratio = sum(plain["state_bytes"].values()) / plain["whole_bytes"]
        assert plain_ratio == pytest.approx(1.0, abs=1e-6) and plain_ratio > BOUND[world]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["tied", "hf"])
def test_blocks_are_freed_after_their_forward(parity_runs, model):
    """When the backward starts, only the root's parameters (the tied embedding and head) are whole under zero3.
    Control: the fsdp2 engine without parameter sharding, and plain ds_mirrored, hold every parameter whole then."""
    out = parity_runs(2)
    zero3 = probe(out, f"{model}-zero3", 0)
    assert zero3["units"] == 5 and zero3["gathered_after_forward"] < 0.3, zero3
    assert probe(out, f"{model}-plain", 0)["gathered_after_forward"] == 1.0
    if model == "tied":
        assert probe(out, "tied-fsdp2", 0)["gathered_after_forward"] == 1.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["tied", "hf"])
def test_cpu_offload_keeps_the_shards_in_host_memory_and_matches_plain(parity_runs, model):
    """On this CPU-only machine host memory is the device too, so the check is the policy every unit runs under, then
    where the shards are; zero3 without offload runs torch's default policy (the control)."""
    out = parity_runs(2)
    for rank in range(2):
        seen = probe(out, f"{model}-offload", rank)
        assert seen["offload_policies"] == ["CPUOffloadPolicy"] and seen["units"] == 5
        assert seen["param_devices"] == seen["state_devices"] == ["cpu"] and seen["dtensor"]
        assert probe(out, f"{model}-zero3", rank)["offload_policies"] == ["OffloadPolicy"]
    assert_parity(out, model, "offload", 2)


# --- accumulation, manual optimization, bf16-mixed (2 ranks) -------------------------------------------------------


@pytest.fixture(scope="module")
def compose_runs(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("zero3_compose"), "compose", 2)


@pytest.mark.multiprocess
def test_accumulation_matches_plain_and_skips_the_reduce_scatter(compose_runs):
    """accumulate_grad_batches=2: 8 micro-batches, 4 steps. zero3 switches gradient synchronisation off for the first
    micro-batch of every window (counted on every rank: 4 off, 4 on; no accumulation would count none). Validation
    after steps 2 and 4 gathers each block for its forward (under no_grad) and training goes on."""
    out = compose_runs
    assert params(out / "accum-zero3", 0)["batches_this_run"] == 2 * STEPS
    for rank in range(2):
        assert json.loads((out / f"accum-syncs.rank{rank}.json").read_text()) == {"off": STEPS, "on": STEPS}
        plain_val = probe(out, "accum-plain", rank)["val_losses"]
        assert len(plain_val) == 2
        assert_close(probe(out, "accum-zero3", rank)["val_losses"], plain_val, atol=1e-5, rtol=1e-5)
    assert_parity(out, "accum", "zero3", 2)


@pytest.mark.multiprocess
def test_manual_optimization_with_clipping_matches_plain(compose_runs):
    assert probe(compose_runs, "manual-zero3", 0)["dtensor"]  # the user's own optimizer over the shards
    assert not probe(compose_runs, "manual-plain", 0)["dtensor"]
    assert_parity(compose_runs, "manual", "zero3", 2)


@pytest.mark.multiprocess
def test_bf16_mixed_gathers_bf16_and_keeps_fp32_shards_and_gradients(compose_runs):
    """Under bf16-mixed each block sees bf16 parameters in its forward (plain's autocast sees fp32: the control),
    while the shards, their gradients and the optimizer stay fp32. The two arms round differently (plain keeps
    embeddings and norms fp32 inside autocast), so parity is bf16's: losses within 1e-3 at every step, and the final
    weights within 10% of the distance training moved them (measured: 0.035)."""
    out = compose_runs
    plain, zero3 = probe(out, "bf16-plain", 0), probe(out, "bf16-zero3", 0)
    assert zero3["gather_dtypes"] == [str(torch.bfloat16)] and zero3["block_dtype"] == str(torch.bfloat16)
    assert plain["block_dtype"] == str(torch.float32)
    assert zero3["grad_dtypes"] == [str(torch.float32)]
    final_plain, final_zero3 = (params(out / f"bf16-{arm}", 0)["state_dict"] for arm in ("plain", "zero3"))
    assert {v.dtype for v in final_zero3.values() if v.is_floating_point()} == {torch.float32}
    for rank in range(2):
        assert_close(
            probe(out, "bf16-zero3", rank)["losses"], probe(out, "bf16-plain", rank)["losses"], atol=1e-3, rtol=0
        )
    pl.seed_everything(0, verbose=False)
    initial = tied_gpt().state_dict()
    floats = [k for k, v in final_plain.items() if v.is_floating_point()]
    apart = torch.cat([(final_zero3[k] - final_plain[k]).flatten() for k in floats]).norm()
    moved = torch.cat([(final_plain[k] - initial[k]).flatten() for k in floats]).norm()
    print(f"bf16-mixed: zero3 ends {apart / moved:.3f} of the distance moved from plain")
    assert apart < 0.1 * moved


# --- BackupAndRestore, GradientAccumulation and LRScaling --------------------------------------------------------


@pytest.mark.multiprocess
def test_accumulation_lr_scaling_and_a_backup_resume_match_plain(tmp_path):
    """The shared composed run (GradientAccumulation to a global batch of 32, LRScaling, a per-step StepLR and
    BackupAndRestore every 2 steps): matches plain, and a run killed at step 5 restores exactly from a backup, every
    sample once per epoch; each rank holds about half the optimizer state (plain: all of it, the control)."""
    state = assert_composed_run_matches_plain_and_resumes(tmp_path, {"shard_parameters": True}, {})
    plain_latest = sorted((tmp_path / "plain_backups").glob("backup-step*.ckpt"))[-1]
    plain_state = torch.load(plain_latest, weights_only=True)["optimizer_states"][0]["state"]
    # Whole tensors in the plain layout, as plain's backup holds them, not this rank's shards.
    assert {k: v["exp_avg"].shape for k, v in state.items()} == {k: v["exp_avg"].shape for k, v in plain_state.items()}
