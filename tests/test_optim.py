"""The hand-written AdamW against torch.optim.AdamW, its parameter groups, and the schedules."""

from __future__ import annotations

import io
import math
from itertools import pairwise

import pytest
import torch

from gptcore.config import ModelConfig, OptimConfig
from gptcore.model import GPT
from gptcore.optim import AdamW, lr_at, param_groups, warmup_steps

CFG = ModelConfig(style="gpt2", n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64)
OPT = OptimConfig(lr=3e-3, weight_decay=0.1, warmup=5, min_lr_ratio=0.1)
STEPS = 50


def fresh_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def make_optimizer(kind: str, model: GPT, decay_embeddings: bool) -> torch.optim.Optimizer:
    groups = param_groups(model, OPT.weight_decay, decay_embeddings)
    kw = dict(lr=OPT.lr, betas=(OPT.beta1, OPT.beta2), eps=OPT.eps)
    if kind == "ours":
        return AdamW(groups, **kw)
    return torch.optim.AdamW(groups, foreach=kind == "torch-foreach", **kw)


def train(model: GPT, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    """Steps start..stop-1 with a scheduled lr and a batch fixed by the step number."""
    for step in range(start, stop):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, STEPS, OPT)
        gen = torch.Generator().manual_seed(step)
        idx = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=gen)
        targets = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=gen)
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def run(kind: str, decay_embeddings: bool) -> GPT:
    model = fresh_model()
    train(model, make_optimizer(kind, model, decay_embeddings), 0, STEPS)
    return model


def assert_same_params(a: GPT, b: GPT) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=name)


def roundtrip(state: dict) -> dict:
    """Through bytes, as a checkpoint would: torch.save then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_matches_torch_adamw_including_a_state_dict_round_trip(decay_embeddings: bool) -> None:
    ours = run("ours", decay_embeddings)
    torch_foreach = run("torch-foreach", decay_embeddings)
    torch_loop = run("torch-loop", decay_embeddings)
    assert_same_params(ours, torch_foreach)
    assert_same_params(ours, torch_loop)
    assert not torch.equal(ours.tok_emb.weight, fresh_model().tok_emb.weight)  # it did train

    # Stop at step 25, rebuild everything from the saved state, continue to the end.
    model = fresh_model()
    opt = make_optimizer("ours", model, decay_embeddings)
    train(model, opt, 0, 25)
    model_state, opt_state = model.state_dict(), opt.state_dict()

    def resume_with(kind: str) -> GPT:
        # A fresh copy each time: load_state_dict keeps the given tensors, which training mutates.
        resumed = GPT(CFG)
        resumed.load_state_dict(roundtrip(model_state))
        resumed_opt = make_optimizer(kind, resumed, decay_embeddings)
        resumed_opt.load_state_dict(roundtrip(opt_state))
        train(resumed, resumed_opt, 25, STEPS)
        return resumed

    resumed = resume_with("ours")
    assert_same_params(resumed, ours)
    assert_same_params(resumed, torch_foreach)
    # The state dict is torch's own layout: torch.optim.AdamW can pick it up and continue.
    assert_same_params(resume_with("torch-foreach"), ours)


def test_state_layout_matches_torch() -> None:
    models = {kind: fresh_model() for kind in ("ours", "torch-foreach")}
    states = {}
    for kind, model in models.items():
        opt = make_optimizer(kind, model, True)
        train(model, opt, 0, 3)
        states[kind] = opt.state_dict()
    ours, theirs = states["ours"], states["torch-foreach"]
    assert ours["state"].keys() == theirs["state"].keys()
    for key, state in ours["state"].items():
        assert state.keys() == theirs["state"][key].keys() == {"step", "exp_avg", "exp_avg_sq"}
        step = state["step"]
        assert step.dtype == torch.float32 and step.dim() == 0 and step.item() == 3.0
        assert step.device.type == "cpu"
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]


def test_parameters_without_grad_are_left_alone() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = AdamW([a, b], lr=0.1, weight_decay=0.5)
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b, torch.ones(3)) and b not in opt.state
    assert a[0].item() == pytest.approx(1 * (1 - 0.1 * 0.5) - 0.1, rel=1e-6)  # wd, then ~lr*sign


def test_parameters_at_different_step_counts_match_torch() -> None:
    """A parameter that misses some gradients lags in steps; its bias correction is its own."""
    runs = {}
    for kind in ("ours", "torch"):
        torch.manual_seed(0)
        a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))
        cls = AdamW if kind == "ours" else torch.optim.AdamW
        opt = cls([a, b], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        for step in range(12):
            a.grad = torch.randn(5, 3)
            b.grad = torch.randn(4) if step % 3 == 0 else None
            opt.step()
        runs[kind] = (a, b, opt.state[b]["step"].item())
    assert runs["ours"][2] == runs["torch"][2] == 4.0
    for ours, theirs in zip(runs["ours"][:2], runs["torch"][:2], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- parameter groups


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_param_groups(style: str, decay_embeddings: bool) -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(style=style, n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64))
    model.norm_f.weight.requires_grad_(False)  # frozen parameters are not optimized
    groups = {g["name"]: g for g in param_groups(model, 0.1, decay_embeddings)}
    assert set(groups) == {"decay", "no_decay"}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0

    names = {id(p): n for n, p in model.named_parameters()}
    listed = [id(p) for g in groups.values() for p in g["params"]]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(listed) == sorted(trainable)  # each trainable parameter exactly once
    decayed = {names[id(p)] for p in groups["decay"]["params"]}
    embeddings = {"tok_emb.weight"} | ({"pos_emb.weight"} if style == "gpt2" else set())
    for name in names.values():
        if name == "norm_f.weight":
            assert name not in decayed
        elif name in embeddings:
            assert (name in decayed) == decay_embeddings, name
        elif "norm" in name or name.endswith(".bias"):
            assert name not in decayed, name
        else:
            assert name.endswith(".weight") and name in decayed, name


# ---------------------------------------------------------------- schedules


def test_warmup_steps_from_steps_or_fraction() -> None:
    assert warmup_steps(1000, 0.05) == 50
    assert warmup_steps(1000, 50) == 50
    assert warmup_steps(1000, 50.0) == 50
    assert warmup_steps(30, 0.05) == 2  # 1.5 rounds up
    assert warmup_steps(1000, 0) == 0


def test_cosine_schedule() -> None:
    cfg = OptimConfig(lr=1e-3, warmup=10, schedule="cosine", min_lr_ratio=0.1)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4)
    assert all(b > a for a, b in pairwise(lrs[:10]))  # warmup rises linearly
    assert lrs[9] == pytest.approx(1e-3)  # warmup ends exactly at the peak
    assert all(b < a for a, b in pairwise(lrs[9:]))  # then strictly decreases
    assert lrs[99] == pytest.approx(1e-4)  # to the floor at the last step
    mid = 9 + (99 - 9) // 2
    assert lrs[mid] == pytest.approx(0.5 * (1e-3 + 1e-4))
    assert lr_at(150, 100, cfg) == pytest.approx(1e-4)  # past the end: floor


def test_wsd_schedule() -> None:
    cfg = OptimConfig(lr=1e-3, warmup=10, schedule="wsd", min_lr_ratio=0.0, decay_fraction=0.2)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[9] == pytest.approx(1e-3)
    assert all(lr == pytest.approx(1e-3) for lr in lrs[9:80])  # stable
    steps = [a - b for a, b in pairwise(lrs[79:])]
    assert all(s == pytest.approx(1e-3 / 20) for s in steps)  # linear over the last 20 steps
    assert lrs[99] == pytest.approx(0.0, abs=1e-12)


def test_constant_schedule_and_no_warmup() -> None:
    cfg = OptimConfig(lr=2e-3, warmup=0.1, schedule="constant")
    lrs = [lr_at(s, 50, cfg) for s in range(50)]
    assert lrs[0] == pytest.approx(2e-3 / 5) and lrs[4] == pytest.approx(2e-3)
    assert all(lr == 2e-3 for lr in lrs[4:])
    no_warmup = OptimConfig(lr=2e-3, warmup=0, schedule="cosine", min_lr_ratio=0.0)
    assert lr_at(0, 50, no_warmup) == pytest.approx(2e-3)
    assert lr_at(49, 50, no_warmup) == pytest.approx(0.0, abs=1e-12)
    assert math.isclose(lr_at(0, 1, no_warmup), 2e-3)  # a one-step run does not divide by 0
