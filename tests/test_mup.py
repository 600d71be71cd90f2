"""µP (`model.mup_base_width`): the base width is today's model bit for bit; at m = d_model / base
the hidden matrices get init std / sqrt(m), lr / m and weight decay x m, the logits 1/m; LoRA on
a µP base trains; and the coordinate check: activations flat in width under µP, growing under
the standard parametrization."""

from __future__ import annotations

import pytest
import torch

from gptcore.checkpoint import save_checkpoint
from gptcore.config import ModelConfig, load_config
from gptcore.data import TokenData
from gptcore.errors import UserError
from gptcore.lora import model_from_state
from gptcore.model import GPT
from gptcore.mup import coord_batches, coord_check, width_slopes
from gptcore.optim import lr_at
from gptcore.train import Trainer
from tests.conftest import assert_user_error, run_cli, tiny_config_text

LLAMA = ['model.style="llama"', "model.n_head=4", "model.n_kv_head=2"]


def trainer(tiny_data, tmp_path, *overrides: str) -> Trainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "exp.toml"
    path.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    return Trainer(load_config(path, ["train.precision=fp32", *overrides]), log=None)


@pytest.mark.parametrize("style", [[], LLAMA], ids=["gpt2", "llama"])
def test_the_base_width_is_todays_model_bit_for_bit(tiny_data, tmp_path, style):
    """mup_base_width = d_model (m = 1) runs the µP code path (three parameter groups, the logit
    multiplier) and gives exactly today's weights and losses, step after step."""
    today = trainer(tiny_data, tmp_path / "sp", *style)
    mup = trainer(tiny_data, tmp_path / "mup", *style, "model.mup_base_width=64")
    assert [g["name"] for g in mup.optimizer.param_groups] == ["hidden", "decay", "no_decay"]
    assert [g["name"] for g in today.optimizer.param_groups] == ["decay", "no_decay"]
    assert mup.model.logit_mult == 1.0 and today.model.logit_mult is None
    for name, weight in today.model.state_dict().items():
        assert torch.equal(weight, mup.model.state_dict()[name]), name
    losses = [(today.train_step()["loss"], mup.train_step()["loss"]) for _ in range(5)]
    assert all(a == b for a, b in losses), losses
    assert losses[-1][0] < losses[0][0]  # it trained
    for name, weight in today.model.state_dict().items():
        assert torch.equal(weight, mup.model.state_dict()[name]), name


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_wider_than_the_base_scales_init_lr_decay_and_logits(style):
    """m = 4: the block linears' init std is 0.02 / 2 (the proj writes also / sqrt(2 n_layer)),
    embeddings keep 0.02; the hidden group has lr x 1/4 and weight decay x 4; logits are the
    tied head's / 4."""
    cfg = ModelConfig(style=style, n_layer=2, n_head=16, d_model=256, vocab_size=512, mup_base_width=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    block = model.blocks[0]
    first = block.attn.qkv.weight if style == "gpt2" else block.mlp.gate.weight
    assert first.std().item() == pytest.approx(0.01, rel=0.05)
    assert block.mlp.proj.weight.std().item() == pytest.approx(0.01 / 2, rel=0.05)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)

    from gptcore.optim import param_groups

    groups = {g["name"]: g for g in param_groups(model, 0.1, mup_width_mult=cfg.width_mult)}
    hidden = {id(p) for p in groups["hidden"]["params"]}
    linears = {id(m.weight) for b in model.blocks for m in b.modules() if isinstance(m, torch.nn.Linear)}
    assert hidden == linears
    assert groups["hidden"]["lr_mult"] == 0.25 and groups["hidden"]["weight_decay"] == pytest.approx(0.4)
    assert id(model.tok_emb.weight) in {id(p) for p in groups["decay"]["params"]}
    assert "lr_mult" not in groups["decay"] and "lr_mult" not in groups["no_decay"]

    idx = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        logits, _ = model(idx)
        hidden_states = model._hidden(idx)
    torch.testing.assert_close(logits, hidden_states @ model.tok_emb.weight.t() / 4, rtol=1e-5, atol=1e-6)
    cfg.mup_output_mult = 3.0  # µP's output multiplier: x3 at the base width, then / m
    assert GPT(cfg).logit_mult == 0.75


def test_the_output_multiplier_is_mup_only_and_positive():
    with pytest.raises(UserError, match="needs model.mup_base_width"):
        load_config(None, ["model.mup_output_mult=2.0"])
    with pytest.raises(UserError, match="model.mup_output_mult=0.0 must be > 0"):
        load_config(None, ["model.mup_base_width=64", "model.mup_output_mult=0.0"])


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_an_infinite_multiplier_is_refused_on_the_command_line_and_in_a_sweep_space(tmp_path, value):
    """inf would be accepted by "> 0" and diverge a run later: every float key must be finite."""
    with pytest.raises(UserError, match=f"model.mup_output_mult={value} must be a finite number"):
        load_config(None, ["model.mup_base_width=64", f"model.mup_output_mult={value}"])
    config = tmp_path / "sweep.toml"
    config.write_text(
        tiny_config_text(tmp_path / "data", tmp_path / "run").replace(
            'preset = "tiny"', 'preset = "tiny"\nmup_base_width = 64'
        )
        + f"\n[sweep.space]\nlr = {{ loguniform = [1e-4, 1e-2] }}\n"
        f'"model.mup_output_mult" = {{ choice = [{value}, 1.0] }}\n'
    )
    proc = run_cli("plan", str(config))
    assert_user_error(proc, "model.mup_output_mult", "must be a finite number")
    config.write_text(config.read_text().replace(f"choice = [{value}, 1.0]", f"uniform = [1.0, {value}]"))
    assert_user_error(run_cli("plan", str(config)), "finite numbers")


def test_the_trainer_gives_hidden_matrices_lr_over_m(tiny_data, tmp_path):
    t = trainer(tiny_data, tmp_path, "model.mup_base_width=16", "train.max_steps=10")  # d_model 64: m = 4
    t.train_step()
    scheduled = lr_at(0, t.total_steps, t.cfg.optim)
    lrs = {g["name"]: g["lr"] for g in t.optimizer.param_groups}
    assert lrs == {"hidden": pytest.approx(scheduled / 4), "decay": scheduled, "no_decay": scheduled}


def test_lora_on_a_mup_base_trains_and_merges(tiny_data, tmp_path):
    """A LoRA run on a µP checkpoint: the frozen base keeps its logit multiplier, the adapters
    (not hidden matrices: their lr is the plain one) train, and the merged model is the run's."""
    base = trainer(tiny_data, tmp_path / "base", "model.mup_base_width=16", "train.max_steps=6")
    base.fit()
    ckpt = save_checkpoint(tmp_path / "base.pt", base.state_dict())
    lora = trainer(
        tiny_data,
        tmp_path / "lora",
        "model.mup_base_width=16",
        f'train.init_from="{ckpt}"',
        "lora.rank=4",
        "optim.lr=1e-2",
        "train.max_steps=8",
    )
    assert [g["name"] for g in lora.optimizer.param_groups] == ["decay"]  # adapters only
    before = lora.evaluate()["val_loss"]
    lora.fit()
    assert lora.evaluate()["val_loss"] < before
    merged = model_from_state(lora.state_dict())
    x = torch.randint(0, 384, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(merged(x)[0], lora.model(x)[0], atol=1e-5, rtol=0)
    assert merged.logit_mult == 0.25


# ---------------------------------------------------------------- the coordinate check


@pytest.fixture(scope="module")
def batches(tiny_data) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """16 batches of one 32-token window: each check averages over them, an init seed each."""
    return coord_batches(TokenData(tiny_data), 16)


def test_coordinate_check_is_flat_in_width_under_mup_and_grows_under_sp(batches):
    """Widths 64/128/256, depth 2, d_head 16, 5 AdamW steps at lr 1e-2: under µP the slope of
    log mean |activation| against log width stays within +-0.15 for the embedding, both blocks and
    the logits; under the standard parametrization the blocks and the logits grow with width.
    (llama: benchmarks/mup_coord_check.py --style llama, too slow for CI at widths past 256.)"""
    widths, kwargs = [64, 128, 256], dict(lr=1e-2, steps=5, style="gpt2")
    mup = width_slopes(widths, coord_check(widths, batches, 384, mup=True, **kwargs))
    sp = width_slopes(widths, coord_check(widths, batches, 384, mup=False, **kwargs))
    assert set(mup) == {"embedding", "block 0", "block 1", "logits"}
    assert all(abs(slope) <= 0.15 for slope in mup.values()), mup
    assert sp["logits"] > 0.4 and sp["block 0"] > 1.0 and sp["block 1"] > 1.0, sp
