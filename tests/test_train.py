"""The training loop: accumulation, exact resume, guards, checkpoints, and `gptrun train --local`."""

from __future__ import annotations

import math

import pytest
import torch

from gptcore.checkpoint import load_checkpoint, save_checkpoint
from gptcore.config import load_config
from gptcore.errors import DivergedError, UserError
from gptcore.run import train_local
from gptcore.train import Trainer
from tests.conftest import assert_user_error, run_cli, tiny_config_text


def make_config(tiny_data, tmp_path, *overrides: str):
    path = tmp_path / "exp.toml"
    path.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    return load_config(path, list(overrides))


def record_losses(trainer: Trainer) -> list[float]:
    """Wrap train_step so every step's loss is kept."""
    losses: list[float] = []
    step = trainer.train_step

    def recording() -> dict[str, float]:
        metrics = step()
        losses.append(metrics["loss"])
        return metrics

    trainer.train_step = recording
    return losses


def capture_grads(trainer: Trainer) -> list[list[torch.Tensor]]:
    """Keep a copy of the gradients the optimizer is about to apply, step by step."""
    grads: list[list[torch.Tensor]] = []
    step = trainer.optimizer.step

    def capturing(*args, **kwargs):
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
        return step(*args, **kwargs)

    trainer.optimizer.step = capturing
    return grads


def test_grad_accumulation_matches_one_big_batch(tiny_data, tmp_path):
    big = Trainer(make_config(tiny_data, tmp_path, "train.batch_size=8"), log=None)
    small = Trainer(make_config(tiny_data, tmp_path, "train.batch_size=2", "train.grad_accum=4"),
                    log=None)
    small.model.load_state_dict(big.model.state_dict())
    big_grads, small_grads = capture_grads(big), capture_grads(small)
    for _ in range(3):
        assert big.train_step()["loss"] == pytest.approx(small.train_step()["loss"], abs=1e-6)
    for step_a, step_b in zip(big_grads, small_grads, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=0)
    for a, b in zip(big.model.parameters(), small.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_resume_is_bit_identical(tiny_data, tmp_path):
    cfg = make_config(tiny_data, tmp_path, "train.max_steps=12")
    full = Trainer(cfg, log=None)
    full_losses = record_losses(full)
    full.fit()

    first = Trainer(cfg, log=None)
    first_losses = record_losses(first)
    saved = {}
    first.fit(on_report=lambda m, state: saved.update(state=state) if state else None,
              stop_at_step=6)
    path = save_checkpoint(tmp_path / "mid.pt", saved["state"])

    second = Trainer(cfg, log=None)
    second.load_state_dict(load_checkpoint(path))
    assert second.step == 6
    second_losses = record_losses(second)
    second.fit()
    assert first_losses + second_losses == full_losses  # bit-identical, not approximately
    for a, b in zip(full.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_training_lowers_validation_loss(tiny_data, tmp_path):
    trainer = Trainer(make_config(tiny_data, tmp_path, "train.max_steps=40"), log=None)
    before = trainer.evaluate()["val_loss"]
    after = trainer.fit()["val_loss"]
    assert before == pytest.approx(math.log(384), rel=0.1)  # GPT-2 init starts near uniform
    assert after < before - 0.5
    assert trainer.tokens_seen == 40 * 4 * 32


def poison_batches(trainer: Trainer, bad: set[int]) -> None:
    """Make the loss NaN for the given batch indices, as a broken batch would."""
    forward = trainer.step_model.forward

    def poisoned(x, y=None, **kw):
        logits, loss = forward(x, y, **kw)
        if loss is not None and trainer.model.training and trainer.batch_index in bad:
            loss = loss * float("nan")
        return logits, loss

    trainer.step_model.forward = poisoned


def test_nan_batch_is_skipped_and_counted(tiny_data, tmp_path):
    trainer = Trainer(make_config(tiny_data, tmp_path), log=None)
    poison_batches(trainer, {3})
    result = trainer.fit()
    assert trainer.bad_steps == 1 and trainer.rollbacks == 0
    assert trainer.step == 12 and trainer.batch_index == 13  # the bad batch was skipped
    assert math.isfinite(result["val_loss"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_bad_streak_rolls_back_and_halves_lr(tiny_data, tmp_path):
    cfg = make_config(tiny_data, tmp_path, "train.max_bad_steps=3")
    trainer = Trainer(cfg, log=None)
    poison_batches(trainer, {6, 7, 8})  # three in a row after the step-4 checkpoint
    trainer.fit()
    assert trainer.rollbacks == 1 and trainer.lr_scale == 0.5 and trainer.bad_steps == 3
    assert trainer.step == 12


def test_endless_nan_stops_as_diverged(tiny_data, tmp_path):
    cfg = make_config(tiny_data, tmp_path, "train.max_bad_steps=2", "train.max_rollbacks=2")
    trainer = Trainer(cfg, log=None)
    poison_batches(trainer, set(range(5, 1000)))
    with pytest.raises(DivergedError, match="after 2 rollbacks"):
        trainer.fit()
    assert trainer.rollbacks == 2


def test_corrupt_and_truncated_checkpoints_are_named(tiny_data, tmp_path):
    trainer = Trainer(make_config(tiny_data, tmp_path), log=None)
    path = save_checkpoint(tmp_path / "ok.pt", trainer.state_dict())
    assert load_checkpoint(path)["step"] == 0
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated.pt is corrupt or truncated"):
        load_checkpoint(truncated)
    tampered = torch.load(path, weights_only=True)
    next(iter(tampered["model"].values())).add_(1.0)
    torch.save(tampered, tmp_path / "tampered.pt")
    with pytest.raises(UserError, match="tampered.pt failed its checksum"):
        load_checkpoint(tmp_path / "tampered.pt")


def test_local_run_resumes_and_refuses_another_shape(tiny_data, tmp_path, capsys):
    cfg = make_config(tiny_data, tmp_path, "train.max_steps=8")
    first = train_local(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "last.pt").exists() and (ckpts / "best.pt").exists()
    longer = make_config(tiny_data, tmp_path, "train.max_steps=12")
    second = train_local(longer)
    assert "resumed from" in capsys.readouterr().out
    assert second["step"] == 12 and first["step"] == 8
    other = make_config(tiny_data, tmp_path, "model.n_layer=3")
    with pytest.raises(UserError, match="another model shape .*n_layer: 2 vs 3"):
        train_local(other)


def test_cli_train_local_then_sample(tiny_data, tmp_path):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    proc = run_cli("train", str(config), "--local", "--set", "train.max_steps=8")
    assert proc.returncode == 0, proc.stderr
    assert "eval step 8" in proc.stdout and "last checkpoint" in proc.stdout
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    proc = run_cli("sample", str(ckpt), "--prompt", "KING:", "--max-new-tokens", "20",
                   "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("KING:") and len(proc.stdout) > len("KING:") + 5


@pytest.mark.parametrize("overrides, needle", [
    (["optim.lrr=1e-3"], "optim.lrr; did you mean optim.lr?"),
    (["trian.max_steps=3"], "unknown config section [trian]"),
    (["train.batch_size=\"big\""], "train.batch_size must be a int"),
    (["model.max_positions=16"], "seq_len=32 is larger than the model's positions"),
    (["model.vocab_size=512"], "has a 384-token tokenizer but model.vocab_size=512"),
    (["optim.schedule=\"cosin\""], "did you mean cosine?"),
])
def test_cli_bad_config_is_one_line(tiny_data, tmp_path, overrides, needle):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    args = [a for o in overrides for a in ("--set", o)]
    assert_user_error(run_cli("train", str(config), "--local", *args), needle)


def test_cli_bad_checkpoints_are_one_line(tiny_data, tmp_path):
    assert_user_error(run_cli("sample", str(tmp_path / "missing.pt")), "does not exist")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    assert_user_error(run_cli("sample", str(junk)), "junk.pt is corrupt or truncated")
    data_missing = tmp_path / "exp.toml"
    data_missing.write_text(tiny_config_text(tmp_path / "nodata", tmp_path / "run"))
    assert_user_error(run_cli("train", str(data_missing), "--local"), "nodata")
