"""The bundled GPT on one process: shapes, causality, the pipeline contract, optimizer groups, sampling, learning."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ds_lightning.demos import GPT

_TINY = {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 16}


def _tiny(**kwargs: object) -> GPT:
    torch.manual_seed(0)
    return GPT(**{**_TINY, **kwargs})  # type: ignore[arg-type]


def _text_windows(n: int, length: int) -> torch.Tensor:
    """``n`` fixed windows of ``length`` bytes of real text (this file's own source)."""
    data = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
    return torch.stack([data[i * length : (i + 1) * length] for i in range(n)])


def test_logits_have_one_row_of_256_per_token():
    model = _tiny()
    assert model(torch.randint(0, 256, (3, 16))).shape == (3, 16, 256)
    assert model(torch.randint(0, 256, (2, 5))).shape == (2, 5, 256)
    with pytest.raises(ValueError, match=r"17 tokens is longer than block_size=16"):
        model(torch.randint(0, 256, (1, 17)))


def test_a_later_token_never_changes_earlier_logits():
    model = _tiny().eval()
    x = torch.randint(0, 256, (2, 16))
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().amax() > 1e-4  # the changed position and later ones do see it


# The class docstring's table: these counts are quoted there.
@pytest.mark.parametrize(
    ("kwargs", "count"),
    [
        ({}, 875_520),
        ({"n_layer": 6, "n_head": 6, "d_model": 384}, 10_893_568),
        ({"n_layer": 12, "n_head": 12, "d_model": 768}, 85_547_776),
        ({"n_layer": 14, "n_head": 12, "d_model": 768, "block_size": 256}, 99_821_824),
    ],
)
def test_parameter_counts_span_1m_to_100m(kwargs, count):
    with torch.device("meta"):  # counts without allocating 100M parameters
        model = GPT(**kwargs)
    assert sum(p.numel() for p in model.parameters()) == count
    assert GPT.__doc__ is not None and f"{count / 1e6:.2f} M" in GPT.__doc__


def test_net_is_a_chain_of_tensor_to_tensor_layers_that_splits_anywhere():
    model = _tiny(n_layer=3).eval()
    net = model.net
    assert isinstance(net, nn.Sequential) and len(net) == 3 + 3  # embedding, blocks, norm, head
    x = torch.randint(0, 256, (2, 12))
    h = x
    for layer in net:
        h = layer(h)
        assert isinstance(h, torch.Tensor)
    whole = net(x)
    torch.testing.assert_close(h, whole, rtol=0, atol=0)
    for cut in range(1, len(net)):
        torch.testing.assert_close(net[cut:](net[:cut](x)), whole, rtol=0, atol=0)
    # no parameter is shared between layers, so stages never share one
    ids = [id(p) for layer in net for p in layer.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


def test_pipeline_loss_is_the_mean_cross_entropy_over_every_token():
    model = _tiny()
    output, target = torch.randn(3, 7, 256), torch.randint(0, 256, (3, 7))
    loss = model.pipeline_loss(output, target)
    torch.testing.assert_close(loss, F.cross_entropy(output.reshape(-1, 256), target.reshape(-1)))
    by_hand = -F.log_softmax(output, dim=-1).gather(-1, target.unsqueeze(-1)).mean()
    torch.testing.assert_close(loss, by_hand)


def test_init_is_seeded_and_scales_the_residual_projections():
    torch.manual_seed(3)
    a = GPT(n_layer=8, d_model=128)
    torch.manual_seed(3)
    b = GPT(n_layer=8, d_model=128)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    block = a.net[1]
    assert math.isclose(block.attn.qkv.weight.std().item(), 0.02, rel_tol=0.05)
    assert math.isclose(block.attn.proj.weight.std().item(), 0.02 / 4, rel_tol=0.05)
    assert math.isclose(block.mlp[2].weight.std().item(), 0.02 / 4, rel_tol=0.05)
    assert math.isclose(a.net[0].token.weight.std().item(), 0.02, rel_tol=0.05)
    assert not any(m.bias.any() for m in a.net.modules() if isinstance(m, nn.Linear))


def test_optimizer_decays_matrices_only_in_the_same_two_groups_on_any_stage():
    model = _tiny(weight_decay=0.2, lr=1e-3)
    opt = model.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.2 and no_decay["weight_decay"] == 0.0
    assert decay["lr"] == no_decay["lr"] == 1e-3 and decay["betas"] == (0.9, 0.95)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in decay["params"]} == {n for n, p in model.named_parameters() if p.dim() >= 2}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "net.1.attn.qkv.bias" in no_decay_names and "net.3.weight" in no_decay_names  # a bias, the final norm
    assert all(model.get_parameter(n).dim() == 1 for n in no_decay_names)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))

    # Under ds_pipeline a stage's module holds only its own layers; the groups stay the same two, in order.
    model.net = nn.Sequential(*list(model.net)[2:])  # last block, final norm, head
    stage = model.configure_optimizers()
    assert [g["weight_decay"] for g in stage.param_groups] == [0.2, 0.0]
    assert {id(p) for g in stage.param_groups for p in g["params"]} == {id(p) for p in model.net.parameters()}

    # A stage with no bias or norm keeps an empty second group, and AdamW steps with it.
    model.net = nn.Sequential(nn.Linear(4, 4, bias=False))
    lonely = model.configure_optimizers()
    assert [len(g["params"]) for g in lonely.param_groups] == [1, 0]
    model.net(torch.randn(2, 4)).sum().backward()
    before = model.net[0].weight.detach().clone()
    lonely.step()
    assert not torch.equal(before, model.net[0].weight)


def test_generate_tokens_adds_exactly_the_asked_tokens_reproducibly():
    model = _tiny()
    prompt = torch.tensor([72, 105, 33])
    state = torch.get_rng_state()
    out = model.generate_tokens(prompt, 20, seed=7)
    assert out.shape == (23,) and out.dtype == torch.long and torch.equal(out[:3], prompt)
    assert torch.equal(torch.get_rng_state(), state)  # a seeded sample leaves the global RNG alone
    assert torch.equal(model.generate_tokens(prompt, 20, seed=7), out)
    assert not torch.equal(model.generate_tokens(prompt, 20, seed=8), out)
    assert model.generate_tokens(prompt.repeat(2, 1), 5, seed=0).shape == (2, 8)
    assert model.generate_tokens(prompt, 0).shape == (3,)
    # longer than block_size: the context is cropped, generation goes on
    assert model.generate_tokens(torch.zeros(40, dtype=torch.long), 4, seed=0).shape == (44,)
    greedy = model.generate_tokens(prompt, 6, top_k=1, seed=1)
    assert torch.equal(greedy, model.generate_tokens(prompt, 6, top_k=1, seed=2))  # top_k=1 is the argmax


@pytest.mark.parametrize("training", [True, False])
def test_generate_returns_prompt_plus_text_and_restores_the_mode(training):
    model = _tiny(dropout=0.1)
    model.train(training)
    text = model.generate("héllo", 12, temperature=0.8, top_k=40, seed=0)
    assert model.training is training
    assert text.startswith("héllo") and len(text) > len("héllo")
    assert text == model.generate("héllo", 12, temperature=0.8, top_k=40, seed=0)  # dropout is off while sampling


def test_a_few_dozen_steps_on_one_batch_of_text_drive_the_loss_down(tmp_path):
    pl.seed_everything(0)
    windows = _text_windows(8, 33)
    data = TensorDataset(windows[:, :-1], windows[:, 1:])
    model = GPT(n_layer=2, n_head=2, d_model=64, block_size=32, lr=3e-3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=50,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    loader = DataLoader(data, batch_size=8)
    before = trainer.validate(model, loader, verbose=False)[0]
    assert before["val_loss"] > 5.0  # about ln(256) = 5.55 at initialisation
    trainer.fit(model, train_dataloaders=loader)  # no validation during fit
    after = trainer.validate(model, loader, verbose=False)[0]
    assert after["val_loss"] < 1.0
    assert math.isclose(after["val_ppl"], math.exp(after["val_loss"]), rel_tol=1e-3)
    tested = trainer.test(model, loader, verbose=False)[0]
    assert math.isclose(tested["test_loss"], after["val_loss"], rel_tol=1e-4)
    assert math.isclose(tested["test_ppl"], after["val_ppl"], rel_tol=1e-3)


def test_hyperparameters_are_saved():
    model = GPT(n_layer=3, n_head=2, d_model=64, block_size=32, dropout=0.1, lr=1e-3, weight_decay=0.0)
    assert dict(model.hparams) == {
        "n_layer": 3,
        "n_head": 2,
        "d_model": 64,
        "block_size": 32,
        "dropout": 0.1,
        "lr": 1e-3,
        "weight_decay": 0.0,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_layer": 0}, r"n_layer=0 must be an int >= 1"),
        ({"n_head": -2}, r"n_head=-2"),
        ({"d_model": 2.5}, r"d_model=2.5"),
        ({"block_size": True}, r"block_size=True"),
        ({"d_model": 100, "n_head": 3}, r"d_model=100 must be a multiple of n_head=3; e.g. GPT\(d_model=99, n_hea"),
        ({"dropout": 1.0}, r"dropout=1.0 must be in \[0.0, 1.0\)"),
        ({"dropout": -0.1}, r"dropout=-0.1"),
        ({"lr": 0.0}, r"lr=0.0 must be a number > 0"),
        ({"weight_decay": -0.01}, r"weight_decay=-0.01 must be a number >= 0"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPT(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ""}, r"prompt='' is empty"),
        ({"max_new_tokens": -1}, r"max_new_tokens=-1"),
        ({"temperature": 0.0}, r"temperature=0.0 must be a number > 0"),
        ({"top_k": 0}, r"top_k=0"),
    ],
)
def test_bad_sampling_options_name_the_value(kwargs, message):
    model = _tiny()
    with pytest.raises(ValueError, match=message):
        model.generate(**{"prompt": "a", "max_new_tokens": 3, **kwargs})
