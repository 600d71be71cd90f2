"""The training loop: accumulation, exact resume, guards, checkpoints, and `gptrun train --local`."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import zipfile

import pytest
import torch
from tokenizers import Tokenizer

from gptcore import atomic, measured, train
from gptcore import mfu as mfu_mod
from gptcore.checkpoint import TRAILER_BYTES, load_checkpoint, save_checkpoint
from gptcore.config import load_config, run_length
from gptcore.device import resolve_device
from gptcore.errors import DivergedError, UserError
from gptcore.model import GPT
from gptcore.optim import AdamW, lr_at
from gptcore.run import train_local
from gptcore.sample import sample_cli
from gptcore.train import Trainer, dropout_seed
from tests.conftest import REPO, assert_user_error, run_cli, tiny_config_text


def make_config(tiny_data, tmp_path, *overrides: str):
    """The tiny experiment in fp32 unless an override says otherwise: auto would pick bf16 on a CPU
    with fast bf16 and fp32 on another, and these tests compare floats exactly."""
    path = tmp_path / "exp.toml"
    path.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    return load_config(path, ["train.precision=fp32", *overrides])


def record_steps(trainer: Trainer) -> list[dict[str, float]]:
    """Wrap train_step so every step's metrics are kept, read as numbers."""
    steps: list[dict[str, float]] = []
    step = trainer.train_step

    def recording() -> dict:
        record = step()
        steps.append({k: float(v) for k, v in record.items()})
        return record

    trainer.train_step = recording
    return steps


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
    small = Trainer(make_config(tiny_data, tmp_path, "train.batch_size=2", "train.grad_accum=4"), log=None)
    small.model.load_state_dict(big.model.state_dict())
    big_grads, small_grads = capture_grads(big), capture_grads(small)
    for _ in range(3):
        assert big.train_step()["loss"].item() == pytest.approx(small.train_step()["loss"].item(), abs=1e-6)
    for step_a, step_b in zip(big_grads, small_grads, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=0)
    for a, b in zip(big.model.parameters(), small.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_resume_is_bit_identical(tiny_data, tmp_path, dropout, precision):
    cfg = make_config(
        tiny_data, tmp_path, "train.max_steps=12", f"model.dropout={dropout}", f"train.precision={precision}"
    )
    full = Trainer(cfg, log=None)
    full_steps = record_steps(full)
    full.fit()

    first = Trainer(cfg, log=None)
    first_steps = record_steps(first)
    saved = {}
    first.fit(on_report=lambda m, state: saved.update(state=state) if state else None, stop_at_step=6)
    path = save_checkpoint(tmp_path / "mid.pt", saved["state"])

    second = Trainer(cfg, log=None)
    second.load_state_dict(load_checkpoint(path))
    assert second.step == 6
    second_steps = record_steps(second)
    second.fit()
    # bit-identical, not approximately
    assert [m["loss"] for m in first_steps + second_steps] == [m["loss"] for m in full_steps]
    for a, b in zip(full.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert second.precision == precision


def record_forward_dtypes(trainer: Trainer) -> list[tuple[torch.dtype, torch.dtype]]:
    """The (logits, loss) dtypes of every forward of the training step."""
    dtypes: list[tuple[torch.dtype, torch.dtype]] = []
    forward = trainer.step_model.forward

    def recording(*args, **kwargs):
        logits, loss = forward(*args, **kwargs)
        dtypes.append((logits.dtype, loss.dtype))
        return logits, loss

    trainer.step_model.forward = recording
    return dtypes


def test_bf16_tracks_the_fp32_loss_curve(tiny_data, tmp_path):
    """The same 20 steps from the same init in fp32 and in bf16 autocast. bf16 keeps 8 significant
    bits (unit roundoff 2^-9 = 0.2%), but the loss is an fp32 mean over 128 tokens of an fp32
    cross-entropy, so the rounding of bf16 logits mostly averages out: the curves differ by at
    most 5e-4 relative on a Xeon with AMX. 1% per step (5x the unit roundoff) leaves room for
    other CPUs' bf16 kernels, while a run whose bf16 step learns differently (say a gradient lost
    in a cast) drifts out of it within 20 steps; and the curves must differ: bf16 must be in use."""
    curves, dtypes, trainers = {}, {}, {}
    for precision in ("fp32", "bf16"):
        cfg = make_config(tiny_data, tmp_path, "train.max_steps=20", f"train.precision={precision}")
        trainers[precision] = Trainer(cfg, log=None)
        dtypes[precision] = record_forward_dtypes(trainers[precision])
        curves[precision] = [trainers[precision].train_step()["loss"].item() for _ in range(20)]
    assert set(dtypes["fp32"]) == {(torch.float32, torch.float32)}
    assert set(dtypes["bf16"]) == {(torch.bfloat16, torch.float32)}  # matmuls bf16, loss fp32
    for losses in curves.values():
        assert sum(losses[-5:]) / 5 < losses[0] - 1.0  # both learn: ln 384 = 5.95 to ~4
    assert curves["bf16"] != curves["fp32"]
    for step, (a, b) in enumerate(zip(curves["fp32"], curves["bf16"], strict=True)):
        assert b == pytest.approx(a, rel=1e-2), step
    bf16 = trainers["bf16"]  # master weights and optimizer state stay fp32
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    moments = [v for state in bf16.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    assert moments and {v.dtype for v in moments if v.is_floating_point()} == {torch.float32}


def test_a_bf16_checkpoint_is_fp32_and_loads_into_an_fp32_trainer(tiny_data, tmp_path):
    bf16 = Trainer(make_config(tiny_data, tmp_path, "train.precision=bf16"), log=None)
    bf16.fit(stop_at_step=4)
    path = save_checkpoint(tmp_path / "bf16.pt", bf16.state_dict())
    state = load_checkpoint(path)
    assert state["precision"] == "bf16"
    assert {t.dtype for t in state["model"].values()} == {torch.float32}
    moments = [v for s in state["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)]
    assert moments and {v.dtype for v in moments if v.is_floating_point()} == {torch.float32}
    logs: list[str] = []
    fp32 = Trainer(make_config(tiny_data, tmp_path, "train.precision=fp32"), log=logs.append)
    fp32.load_state_dict(state)
    assert "checkpoint was trained in bf16, this run is fp32 (set in train.precision)" in logs[0]
    for a, b in zip(bf16.model.parameters(), fp32.model.parameters(), strict=True):
        assert b.dtype == torch.float32 and torch.equal(a, b)
    # Evaluation follows the precision too: the same weights, close but not equal losses.
    val_bf16, val_fp32 = bf16.evaluate()["val_loss"], fp32.evaluate()["val_loss"]
    assert val_bf16 != val_fp32 and val_bf16 == pytest.approx(val_fp32, rel=1e-2)
    result = fp32.fit()
    assert fp32.step == 12 and math.isfinite(result["val_loss"]) and result["val_loss"] < val_fp32


def fake_cpu_matmul(monkeypatch, tmp_path, bf16_speedup: float) -> list[torch.dtype]:
    """A fresh cache folder and a fake matmul measurement: fp32 100 GFLOP/s, bf16 `bf16_speedup`
    times that. Returns the dtypes measured (nothing is timed)."""
    monkeypatch.setenv("GPTRUN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(mfu_mod, "PEAKS", dataclasses.replace(mfu_mod.PEAKS, gap_s=0.0))
    measured: list[torch.dtype] = []
    rates = {torch.float32: 1e11, torch.bfloat16: bf16_speedup * 1e11}
    monkeypatch.setattr(
        mfu_mod, "_measure_matmul_flops", lambda dtype: measured.append(dtype) or rates[dtype]
    )
    return measured


@pytest.mark.parametrize("remeasured", [1e13, 1e6])
def test_an_mfu_over_100_percent_remeasures_the_peak_or_says_n_a(
    tiny_data, tmp_path, monkeypatch, remeasured
):
    """A cached fp32 peak of 1 MFLOP/s (measured on a busy machine) makes any run's MFU
    impossible: the trainer measures again; a sane figure replaces it, else MFU is n/a."""
    fake_cpu_matmul(monkeypatch, tmp_path, 2.0)
    (tmp_path / "cache").mkdir()
    key = mfu_mod._cpu_key(torch.get_num_threads(), "fp32")
    (tmp_path / "cache" / "cpu_peak_flops.json").write_text(json.dumps({key: 1e6}))
    monkeypatch.setattr(mfu_mod, "_measure_matmul_flops", lambda dtype: remeasured)
    logs: list[str] = []
    trainer = Trainer(make_config(tiny_data, tmp_path, "train.precision=fp32"), log=logs.append)
    trainer.fit()
    progress = [line for line in logs if line.startswith("step ")]
    assert progress and not any(re.search(r"MFU \d{3,}", line) for line in progress), progress
    assert sum("so that peak was too low: measured again" in line for line in logs) == 1
    if remeasured == 1e13:
        assert all(re.search(r"MFU \d{1,2}\.\d%", line) for line in progress), progress
        assert json.loads((tmp_path / "cache" / "cpu_peak_flops.json").read_text())[key] == 1e13
    else:
        assert sum("that peak is wrong, so MFU is n/a for this run" in line for line in logs) == 1
        assert all("MFU n/a" in line for line in progress), progress


@pytest.mark.parametrize(
    "speedup, precision, reason",
    [
        (3.9, "bf16", "auto: bf16 matmul 3.9x fp32 on this CPU"),
        (1.5, "bf16", "auto: bf16 matmul 1.5x fp32 on this CPU"),
        (1.4, "fp32", "auto: bf16 matmul 1.4x fp32 on this CPU, under 1.5x"),
        (0.05, "fp32", "auto: bf16 matmul 0.05x fp32 on this CPU, under 1.5x"),
    ],
)
def test_auto_precision_on_cpu_follows_the_measured_bf16_speedup(
    tiny_data, tmp_path, monkeypatch, speedup, precision, reason
):
    measured = fake_cpu_matmul(monkeypatch, tmp_path, speedup)
    logs: list[str] = []
    trainer = Trainer(make_config(tiny_data, tmp_path, "train.precision=auto"), log=logs.append)
    assert (trainer.precision, trainer.precision_reason) == (precision, reason)
    assert sorted(measured, key=str) == [torch.bfloat16] * 3 + [torch.float32] * 3  # once each
    # MFU is against the peak of the precision chosen.
    assert trainer.peak_flops == (speedup * 1e11 if precision == "bf16" else 1e11)
    assert f"{precision} matmul (the best sample, cached in" in trainer.peak_source
    trainer.fit(stop_at_step=1)
    assert f"| precision {precision} ({reason}) | MFU peak " in logs[1]  # after the run length
    # Another process on this machine: the cached measurement decides, nothing is measured again.
    monkeypatch.setattr(mfu_mod, "_measure_matmul_flops", lambda dtype: pytest.fail("measured again"))
    assert train.resolve_precision("auto", torch.device("cpu")) == (precision, reason)


def test_explicit_precision_is_kept_and_auto_elsewhere_is_fp32(tmp_path, monkeypatch):
    measured = fake_cpu_matmul(monkeypatch, tmp_path, 0.05)
    cpu = torch.device("cpu")
    assert train.resolve_precision("bf16", cpu) == ("bf16", "set in train.precision")  # even if slow
    assert train.resolve_precision("fp32", cpu) == ("fp32", "set in train.precision")
    assert measured == []  # only auto needs the measurement
    assert train.resolve_precision("auto", torch.device("mps"))[0] == "fp32"


def test_auto_precision_on_a_gpu_is_bf16_where_it_has_bf16_units(monkeypatch):
    """No GPU needed: torch.cuda's answers are faked."""
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "NVIDIA H100 80GB HBM3")
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kw: asked.append(kw) or True)
    assert train.resolve_precision("auto", gpu) == ("bf16", "auto: NVIDIA H100 80GB HBM3 has bf16")
    assert train.resolve_precision("fp32", gpu) == ("fp32", "set in train.precision")
    assert asked[0] == {"including_emulation": False}  # emulated bf16 is slower than fp32
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kw: False)
    assert train.resolve_precision("auto", gpu) == ("fp32", "auto: Tesla V100-SXM2-16GB has no bf16")
    with pytest.raises(UserError, match="train.precision=bf16 but Tesla V100-SXM2-16GB has no bf16"):
        train.resolve_precision("bf16", gpu)


def test_unknown_precision_is_refused(tiny_data, tmp_path):
    with pytest.raises(
        UserError, match=r"^train.precision='bf8' is not one of auto, fp32, bf16; did you mean"
    ):
        make_config(tiny_data, tmp_path, 'train.precision="bf8"')


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


def test_rollbacks_compound_and_tokens_never_go_back(tiny_data, tmp_path):
    """Three rollbacks to the same checkpoint: lr scale 1/8, not 1/2; the tokens clock goes on."""
    cfg = make_config(
        tiny_data,
        tmp_path,
        "train.max_bad_steps=2",
        "train.max_rollbacks=3",
        "train.eval_interval=2",
        "train.checkpoint_interval=4",
    )
    trainer = Trainer(cfg, log=None)
    # Batches 0-5 train steps 1-6 (checkpoint at 4, report at 6), then 6 bad batches in a row.
    poison_batches(trainer, set(range(6, 12)))
    steps = record_steps(trainer)
    reports, states = [], []
    trainer.fit(on_report=lambda m, state: (reports.append(m), state and states.append(state)))
    assert trainer.rollbacks == 3 and trainer.bad_steps == 6 and trainer.lr_scale == 0.125
    assert trainer.step == 12 and trainer.batch_index == 20
    first_good = steps[12]  # the first step after the three rollbacks: step 5 again
    assert first_good["lr"] == lr_at(4, 12, cfg.optim) * 0.125
    assert [m["step"] for m in reports] == [2, 4, 6, 6, 8, 10, 12]
    tokens = [m["tokens"] for m in reports]
    assert tokens == [2 * 128, 4 * 128, 6 * 128, 8 * 128, 10 * 128, 12 * 128, 14 * 128]
    assert trainer.tokens_seen == 14 * 128  # steps 5 and 6 were trained, then rolled back
    assert states[-1]["lr_scale"] == 0.125 and states[-1]["rollbacks"] == 3


def test_endless_nan_stops_as_diverged(tiny_data, tmp_path):
    cfg = make_config(tiny_data, tmp_path, "train.max_bad_steps=2", "train.max_rollbacks=2")
    trainer = Trainer(cfg, log=None)
    poison_batches(trainer, set(range(5, 1000)))
    with pytest.raises(DivergedError, match="after 2 rollbacks"):
        trainer.fit()
    assert trainer.rollbacks == 2


def flip(data: bytes, position: int) -> bytes:
    return data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1 :]


def test_any_changed_byte_is_a_damaged_checkpoint(tiny_data, tmp_path):
    trainer = Trainer(make_config(tiny_data, tmp_path), log=None)
    trainer.fit(stop_at_step=2)
    path = save_checkpoint(tmp_path / "ok.pt", trainer.state_dict())
    assert load_checkpoint(path)["step"] == 2
    good = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(good[:-TRAILER_BYTES])) as payload:
        pickle = next(i for i in payload.infolist() if i.filename.endswith("data.pkl"))
    # The pickled metadata (step, data position, config, ...), a stride over the whole file
    # (tensors, zip directory), and every byte of the checksum trailer.
    metadata = range(
        pickle.header_offset, pickle.header_offset + 30 + len(pickle.filename) + pickle.compress_size, 7
    )
    positions = sorted(
        {*metadata, *range(0, len(good), len(good) // 150), *range(len(good) - TRAILER_BYTES - 64, len(good))}
    )
    assert len(positions) > 400
    bad = tmp_path / "bad.pt"
    for position in positions:
        bad.write_bytes(flip(good, position))
        with pytest.raises(UserError, match="damaged checkpoint .*bad.pt"):
            load_checkpoint(bad)
    for damaged in (good[: len(good) // 2], good[:-1], good + b"\0", good[:-TRAILER_BYTES]):
        bad.write_bytes(damaged)
        with pytest.raises(UserError, match="damaged checkpoint .*bad.pt"):
            load_checkpoint(bad)


def test_a_write_the_filesystem_refuses_is_one_line_naming_it(monkeypatch):
    """Any output in a place that cannot be written (sysfs takes no new file, not even root's) is
    a UserError naming it, whichever atomic writer meets it first; the cache of measurements is
    the exception: a cache that cannot be kept costs a measurement next time, not the run."""
    with pytest.raises(UserError, match="^/sys/gptrun/f.txt is not writable .*writable filesystem$"):
        atomic.write_text_atomic("/sys/gptrun/f.txt", "text")
    with pytest.raises(UserError, match="^/sys/gptrun/d is not writable"), atomic.atomic_dir("/sys/gptrun/d"):
        pytest.fail("atomic_dir yielded a folder it could not make")
    monkeypatch.setenv("GPTRUN_CACHE_DIR", "/sys/gptrun")
    with measured.locked_table("measured.json") as table:
        table["figure"] = 1.0


def test_atomic_writes_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    """Data reaches the disk before the new name points at it, and the rename itself is flushed."""
    events: list[tuple[str, int]] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)))

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with atomic.atomic_file(tmp_path / "f.txt") as tmp:
        tmp.write_text("data")
    file_ino, folder_ino = (tmp_path / "f.txt").stat().st_ino, tmp_path.stat().st_ino
    assert events == [("fsync", file_ino), ("replace", file_ino), ("fsync", folder_ino)]

    events.clear()
    with atomic.atomic_dir(tmp_path / "d") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.npy").write_text("a")
    inos = {p: (tmp_path / "d" / p).stat().st_ino for p in ("sub/a.npy", "sub", ".")}
    assert events == [
        ("fsync", inos["sub/a.npy"]),
        ("fsync", inos["sub"]),
        ("fsync", inos["."]),
        ("replace", inos["."]),
        ("fsync", folder_ino),
    ]


def test_atomic_dir_gets_mkdir_permissions_without_setting_the_umask(tmp_path, monkeypatch):
    """The umask is process-wide: setting it, even to read it, races every other thread's files."""
    real_umask = os.umask
    previous = real_umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda _mask: pytest.fail("atomic_dir set the process umask"))
        with atomic.atomic_dir(tmp_path / "d") as tmp:
            (tmp / "f.txt").write_text("x")
    finally:
        real_umask(previous)
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o750  # what mkdir gives under 027
    assert (tmp_path / "d" / "f.txt").read_text() == "x"


def _folder(path, text):
    with atomic.atomic_dir(path) as tmp:
        (tmp / "f.txt").write_text(text)


def test_replacing_a_folder_never_leaves_its_path_empty(tmp_path, monkeypatch):
    """The old and the new folder trade places in one step (Linux's RENAME_EXCHANGE), so no kill
    can fall between two renames: a rename here is where a killed process would stop, and none
    is needed."""
    _folder(tmp_path / "d", "old")

    def killed(src, dst):
        raise RuntimeError("killed")

    monkeypatch.setattr(os, "replace", killed)
    _folder(tmp_path / "d", "new")
    assert (tmp_path / "d" / "f.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # the old version is gone too


def test_a_kill_between_the_two_renames_of_the_fallback_keeps_the_old_folder(tmp_path, monkeypatch):
    """Where no atomic swap exists, `path -> .old` then `tmp -> path`: a kill in between leaves only
    `.old`, which the next run puts back before anything else (it once deleted it)."""
    _folder(tmp_path / "d", "old")
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    real_replace = os.replace

    def killed_after_the_first(src, dst):
        real_replace(src, dst)
        monkeypatch.setattr(os, "replace", real_replace)
        raise RuntimeError("killed")

    monkeypatch.setattr(os, "replace", killed_after_the_first)
    with pytest.raises(RuntimeError, match="killed"):
        _folder(tmp_path / "d", "new")
    assert not (tmp_path / "d").exists() and (tmp_path / ".d.old" / "f.txt").read_text() == "old"
    with pytest.raises(RuntimeError), atomic.atomic_dir(tmp_path / "d"):
        assert (tmp_path / "d" / "f.txt").read_text() == "old"  # restored before any work
        raise RuntimeError("the next run fails too")
    assert (tmp_path / "d" / "f.txt").read_text() == "old"
    _folder(tmp_path / "d", "newer")
    assert (tmp_path / "d" / "f.txt").read_text() == "newer" and not (tmp_path / ".d.old").exists()


def test_local_run_resumes_and_refuses_another_shape(tiny_data, tmp_path, capsys):
    cfg = make_config(tiny_data, tmp_path, "train.max_steps=8")
    first = train_local(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "last.pt").exists() and (ckpts / "best.pt").exists()
    longer = make_config(tiny_data, tmp_path, "train.max_steps=12", "train.extend=true")
    second = train_local(longer)
    out = capsys.readouterr().out
    assert "train.extend: the run's length goes from 8 to 12 steps" in out
    assert "resumed from" in out
    assert second["step"] == 12 and first["step"] == 8
    other = make_config(tiny_data, tmp_path, "model.n_layer=3")
    with pytest.raises(UserError, match="another model shape .*n_layer: 2 vs 3"):
        train_local(other)


def test_rerunning_a_complete_run_says_so_and_writes_nothing(tiny_data, tmp_path, capsys):
    cfg = make_config(tiny_data, tmp_path, "train.max_steps=8")
    first = train_local(cfg)
    run = tmp_path / "run"
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    again = train_local(cfg)
    out = capsys.readouterr().out
    assert f"{run} is a complete run (step 8/8, val loss {first['val_loss']:.4f}): nothing to do" in out
    assert "compile" not in out and "resumed from" not in out
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before
    assert again["val_loss"] == first["val_loss"] and again["step"] == 8


def test_a_rerun_with_another_schedule_is_refused_unless_extended(tiny_data, tmp_path):
    train_local(make_config(tiny_data, tmp_path, "train.max_steps=8"))
    last = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    for overrides, needle in [
        (["train.max_steps=16"], "8-step run but this config makes 16 steps.*--set train.extend=true"),
        (["train.max_tokens=2048"], "8-step run but this config makes 16"),
        (["optim.lr=1e-3", "train.extend=true"], "optim.lr: 0.003 vs 0.001"),
    ]:
        trainer = Trainer(make_config(tiny_data, tmp_path, *overrides), log=None)
        with pytest.raises(UserError, match=needle):
            trainer.load_state_dict(last)  # the resume of --local and of Ray Train alike
    logs: list[str] = []
    extended = Trainer(
        make_config(tiny_data, tmp_path, "train.max_steps=16", "train.extend=true"), log=logs.append
    )
    extended.load_state_dict(last)
    assert extended.step == 8 and extended.total_steps == 16
    assert any("from 8 to 16 steps" in line for line in logs)
    shorter = Trainer(make_config(tiny_data, tmp_path, "train.max_steps=8"), log=None)
    shorter.load_state_dict(last)  # the same length needs no flag
    config = tmp_path / "exp.toml"
    assert_user_error(
        run_cli("train", str(config), "--local", "--set", "train.max_steps=10"), "train.extend=true"
    )


def test_a_run_length_set_on_the_command_line_clears_the_other_key(tiny_data, tmp_path, capsys):
    """The shipped configs set train.max_tokens, which wins over train.max_steps: a --set of
    either is what the user means, so it clears the other, and the first log line names it."""
    path = tmp_path / "exp.toml"  # 128 tokens per step: max_tokens is 32 steps, max_steps 12
    path.write_text(tiny_config_text(tiny_data, tmp_path / "run", max_tokens=4096))
    assert run_length(load_config(path)).total_steps == 32
    capsys.readouterr()
    steps = load_config(path, ["train.max_steps=3", "train.precision=fp32"])
    assert (steps.train.max_steps, steps.train.max_tokens, run_length(steps).total_steps) == (3, 0, 3)
    assert f"--set train.max_steps=3 clears train.max_tokens=4096 (set in {path})" in capsys.readouterr().out
    tokens = load_config(path, ["train.max_tokens=1024"])
    assert (tokens.train.max_steps, run_length(tokens).total_steps) == (0, 8)
    assert "clears train.max_steps=12" in capsys.readouterr().out
    # 0 clears nothing (the file's max_steps is then in force); both given is the user's choice.
    assert run_length(load_config(path, ["train.max_tokens=0"])).total_steps == 12
    assert run_length(load_config(path, ["train.max_tokens=0", "train.max_steps=5"])).total_steps == 5
    with pytest.raises(UserError, match="both train.max_steps and train.max_tokens"):
        load_config(path, ["train.max_tokens=1024", "train.max_steps=5"])
    logs: list[str] = []
    Trainer(steps, log=logs.append).fit()
    assert logs[0] == "run length: 3 steps of 128 tokens (train.max_steps)", logs[0]
    logs.clear()
    Trainer(load_config(path, ["train.precision=fp32"]), log=logs.append).fit(stop_at_step=1)
    assert logs[0] == "run length: 32 steps of 128 tokens (train.max_tokens=4,096; train.max_steps is unused)"


@pytest.mark.parametrize("interrupted_step", [6, 4], ids=["between-evals", "at-an-eval"])
def test_ctrl_c_in_the_middle_of_a_step_resumes_bit_identical(
    tiny_data, tmp_path, monkeypatch, request, interrupted_step
):
    """SIGINT arrives inside a step (batch index moved, optimizer not yet stepped): the interrupt
    checkpoint must still be taken between steps, so the resumed run equals the uninterrupted one,
    and at an eval step (4, with eval_interval 4) after that step's evaluation, so that
    metrics.jsonl has no hole where the run was interrupted."""
    # Python's own Ctrl-C handler, as in `gptrun train --local`: a Ray Train fit() run earlier in
    # this pytest process leaves its handler installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    cfg = make_config(tiny_data, tmp_path, "model.dropout=0.1")
    full = make_config(tiny_data, tmp_path, "model.dropout=0.1", f'train.out="{tmp_path / "full"}"')
    real_step, calls = AdamW.step, []

    def interrupted_step_(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == interrupted_step:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(AdamW, "step", interrupted_step_)
    with pytest.raises(KeyboardInterrupt):
        train_local(cfg)
    monkeypatch.setattr(AdamW, "step", real_step)
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    assert load_checkpoint(last)["step"] == interrupted_step
    assert load_checkpoint(last)["batch_index"] == interrupted_step
    resumed, uninterrupted = train_local(cfg), train_local(full)
    assert resumed["val_loss"] == uninterrupted["val_loss"]
    a, b = (
        load_checkpoint(p / "checkpoints" / "last.pt")["model"] for p in (tmp_path / "run", tmp_path / "full")
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    curves = [
        [(r["step"], r["val_loss"]) for r in map(json.loads, (p / "metrics.jsonl").read_text().splitlines())]
        for p in (tmp_path / "run", tmp_path / "full")
    ]
    assert [step for step, _ in curves[0]] == [4, 8, 12]
    assert curves[0] == curves[1]


def test_bits_per_byte_counts_the_bytes_of_the_evaluated_slice(tiny_data, tmp_path):
    trainer = Trainer(make_config(tiny_data, tmp_path), log=None)
    metrics = trainer.evaluate()
    targets = torch.cat(
        [y.reshape(-1) for _, y in trainer.data.val_batches(seq_len=32, batch_size=4, eval_tokens=2048)]
    )
    assert targets.numel() == trainer.data.num_val_windows(32, 2048) * 32
    tok = Tokenizer.from_file(str(tiny_data / "tokenizer.json"))
    # The slice's targets are consecutive tokens; <|endoftext|> stands for no text.
    nbytes = len(tok.decode(targets.tolist(), skip_special_tokens=True).encode("utf-8"))
    split = json.loads((tiny_data / "meta.json").read_text())["splits"]["val"]
    assert nbytes / targets.numel() != pytest.approx(split["bytes"] / split["tokens"], rel=1e-3)
    nats = metrics["val_loss"] * targets.numel()
    assert metrics["val_bpb"] == pytest.approx(nats / math.log(2) / nbytes, rel=1e-9)


def test_dropout_differs_across_ranks_while_init_does_not(tiny_data, tmp_path, monkeypatch):
    cfg = make_config(tiny_data, tmp_path, "model.dropout=0.5")
    monkeypatch.setattr(train.dist, "all_reduce", lambda tensor, op=None: None)  # no group here
    inits, states = [], []
    for rank in (0, 1):  # each built and stepped in turn, as if in its own process
        trainer = Trainer(cfg, rank=rank, world_size=2, log=None)
        inits.append(copy.deepcopy(trainer.model.state_dict()))
        forward = trainer.step_model.forward
        trainer.step_model.forward = lambda *a, forward=forward, **kw: (
            states.append(torch.get_rng_state()),
            forward(*a, **kw),
        )[1]
        trainer.train_step()
    assert all(torch.equal(inits[0][k], inits[1][k]) for k in inits[0])  # the same init
    assert not torch.equal(states[0], states[1])  # the RNG that draws the dropout masks
    for rank, state in enumerate(states):
        torch.manual_seed(dropout_seed(cfg.train.seed, rank, 0))
        assert torch.equal(torch.get_rng_state(), state)
    assert len({dropout_seed(1337, r, s) for r in range(4) for s in range(100)}) == 400


def test_sample_stops_at_end_of_text_unless_told_not_to(tiny_data, tmp_path, monkeypatch):
    trainer = Trainer(make_config(tiny_data, tmp_path), log=None)
    model, eot = trainer.model, trainer.data.eot_id
    with torch.no_grad():  # every position's hidden state is v, and <|endoftext|> reads v best
        v = torch.randn(model.cfg.d_model)
        model.norm_f.weight.zero_()
        model.norm_f.bias.copy_(v)
        model.tok_emb.weight[eot] = 10 * v
    path = save_checkpoint(tmp_path / "eot.pt", trainer.state_dict())
    outputs: list[torch.Tensor] = []
    generate = GPT.generate
    monkeypatch.setattr(GPT, "generate", lambda *a, **kw: outputs.append(generate(*a, **kw)) or outputs[-1])
    args = dict(
        prompt="KING:",
        max_new_tokens=10,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        use_cache=True,
        tokenizer=None,
        device="cpu",
    )
    assert sample_cli(str(path), **args) == "KING:"
    assert sample_cli(str(path), **args, ignore_eos=True) == "KING:"
    prompt = len(Tokenizer.from_file(str(tiny_data / "tokenizer.json")).encode("KING:").ids)
    assert outputs[0][0].tolist()[prompt:] == [eot]
    assert outputs[1][0].tolist()[prompt:] == [eot] * 10


def test_cli_train_local_then_sample(tiny_data, tmp_path):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    proc = run_cli("train", str(config), "--local", "--set", "train.max_steps=8")
    assert proc.returncode == 0, proc.stderr
    assert "eval step 8" in proc.stdout and "last checkpoint" in proc.stdout
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    proc = run_cli("sample", str(ckpt), "--prompt", "KING:", "--max-new-tokens", "20", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("KING:") and len(proc.stdout) > len("KING:") + 5


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["optim.lrr=1e-3"], "optim.lrr; did you mean optim.lr?"),
        (["trian.max_steps=3"], "unknown config section [trian]"),
        (['train.batch_size="big"'], "train.batch_size must be a int"),
        (["model.max_positions=16"], "seq_len=32 is larger than the model's positions"),
        (["model.vocab_size=512"], "has a 384-token tokenizer but model.vocab_size=512"),
        (['optim.schedule="cosin"'], "did you mean cosine?"),
        (['train.precision="fp16"'], "train.precision='fp16' is not one of auto, fp32, bf16"),
    ],
)
def test_cli_bad_config_is_one_line(tiny_data, tmp_path, overrides, needle):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    args = [a for o in overrides for a in ("--set", o)]
    assert_user_error(run_cli("train", str(config), "--local", *args), needle)


def test_a_device_this_machine_lacks_is_one_line_naming_what_it_has(monkeypatch):
    """As on a one-GPU Linux node: cuda:7 and mps are refused by name, with the devices here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    for name in ("cuda:7", "mps"):
        with pytest.raises(
            UserError,
            match=f"train.device '{name}' is not available on this machine, "
            "which has cpu, cuda:0; use one of those, or auto",
        ):
            resolve_device(name)
    assert [resolve_device(n) for n in ("auto", "cuda", "cuda:0", "cpu")] == [
        torch.device(n) for n in ("cuda", "cuda", "cuda:0", "cpu")
    ]
    with pytest.raises(UserError, match="--device 'gpu' is not a device; use one of auto, cpu, cuda"):
        resolve_device("gpu", "--device")


def test_cli_bad_devices_are_one_line(tiny_data, pretrained, tmp_path):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    assert_user_error(
        run_cli("train", str(config), "--local", "--set", "train.device=cuda:99"),
        "train.device 'cuda:99' is not available on this machine, which has cpu",
    )
    assert_user_error(
        run_cli("train", str(config), "--local", "--set", "train.device=tpu"), "'tpu' is not a device"
    )
    assert_user_error(run_cli("sample", str(pretrained), "--device", "foo"), "--device 'foo' is not a device")
    assert not (tmp_path / "run").exists()


def test_cli_bad_checkpoints_are_one_line(tiny_data, tmp_path):
    assert_user_error(run_cli("sample", str(tmp_path / "missing.pt")), "does not exist")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all, but longer than a checksum trailer is long")
    assert_user_error(run_cli("sample", str(junk)), "damaged checkpoint", "junk.pt")


def test_cli_train_local_bad_out_or_data_is_one_line_and_writes_nothing(tiny_data, tmp_path):
    config = tmp_path / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    (tmp_path / "file").write_text("keep me")
    assert_user_error(
        run_cli("train", str(config), "--local", "--out", str(tmp_path / "file")), "existing file"
    )
    assert (tmp_path / "file").read_text() == "keep me"
    # /proc (Linux, where gptrun and its CI run): no folder can be made there, even by root
    assert_user_error(
        run_cli("train", str(config), "--local", "--out", "/proc/gptrun/run"),
        "/proc/gptrun/run is not writable",
    )
    data_missing = tmp_path / "nodata.toml"
    data_missing.write_text(tiny_config_text(tmp_path / "nodata", tmp_path / "run"))
    assert_user_error(run_cli("train", str(data_missing), "--local"), "nodata")
    assert not (tmp_path / "run").exists()  # no config.toml before the data was found


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_passes_torch_index_to_the_torch_install_only(tmp_path):
    def pip_installs(*args: str) -> list[str]:
        proc = subprocess.run(
            ["make", "-n", "-B", "install", f"VENV={tmp_path}/venv", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        lines = proc.stdout.replace("\\\n", " ").splitlines()  # join continued lines
        return [line for line in lines if "pip install" in line]

    index = "https://download.pytorch.org/whl/cpu"
    installs = pip_installs(f"TORCH_INDEX={index}")
    assert [line for line in installs if "--index-url" in line] == [
        line for line in installs if "torch==2.13.0" in line
    ]
    assert f'--index-url "{index}"' in installs[1] and "torch==2.13.0" in installs[1]
    assert not any("--index-url" in line for line in pip_installs())
