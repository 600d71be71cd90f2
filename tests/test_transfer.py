"""Sweep small, train big: saved configs keep derived keys derived (so a config at another width is
the same config), `[sweep.space]` choices are checked before a sweep starts, and `gptrun transfer`
turns a real µP sweep on a narrow proxy into the wide target's config, or refuses in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from experiments.experiment import start_experiment
from experiments.ray_config import RayExperiment, experiment_from_dict, load_experiment
from experiments.space import apply_overrides, parse_space
from experiments.transfer import carried_keys, check_transferable
from gptcore.config import load_config
from gptcore.errors import UserError
from tests.conftest import (
    assert_user_error,
    run_cli,
    synthetic_documents,
    tiny_config_text,
    write_sweep_config,
)

# ---------------------------------------------------------------- derived keys and presets


def test_a_saved_config_holds_what_the_user_set_and_derives_the_rest(tmp_path):
    cfg = load_config(None, ["model.preset=quickstart", "model.vocab_size=512", "model.dropout=0.1"])
    saved = cfg.to_dict()["model"]
    assert saved["preset"] == "quickstart" and saved["vocab_size"] == 512 and saved["dropout"] == 0.1
    assert not {"n_layer", "d_model", "d_ff", "n_kv_head", "max_positions"} & set(saved)
    path = tmp_path / "saved.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg
    wide = load_config(path, ["model.d_model=512", "model.n_head=16", "model.seq_len=256"])
    assert (wide.model.d_ff, wide.model.n_kv_head, wide.model.max_positions) == (2048, 16, 256)
    explicit = load_config(None, ["model.preset=quickstart", "model.d_ff=300", "model.n_kv_head=2"])
    path.write_text(explicit.to_toml())
    again = load_config(path, ["model.d_model=256"])
    assert (again.model.d_ff, again.model.n_kv_head, again.model.n_layer) == (300, 2, 4)


def test_the_minimind_preset_is_unchanged_by_deriving_its_d_ff():
    m = load_config(None, ["model.preset=minimind-26m"]).model
    assert (m.d_ff, m.n_kv_head, m.n_head, m.d_model) == (1408, 2, 8, 512)


def sweep_cfg(tiny_data: Path, tmp_path: Path, space: str, model: str = "") -> RayExperiment:
    path = tmp_path / "sweep.toml"
    text = tiny_config_text(tiny_data, tmp_path / "run").replace(
        'preset = "tiny"', f'preset = "tiny"\n{model}'
    )
    path.write_text(text + f"\n[sweep.space]\nlr = {{ loguniform = [1e-4, 1e-2] }}\n{space}\n")
    return load_experiment(path)


def test_swept_width_and_heads_rederive_d_ff_and_stay_plain_attention(tiny_data, tmp_path):
    cfg = sweep_cfg(
        tiny_data, tmp_path, '"model.d_model" = { choice = [64, 128] }\n"model.n_head" = { choice = [2, 4] }'
    )
    space = parse_space(cfg)
    trial = apply_overrides(cfg, space.overrides({"optim.lr": 1e-3, "model.d_model": 128, "model.n_head": 4}))
    assert (trial.model.d_model, trial.model.d_ff, trial.model.n_head, trial.model.n_kv_head) == (
        128,
        512,
        4,
        4,
    )


def test_an_explicit_n_kv_head_beside_a_swept_n_head_is_refused(tiny_data, tmp_path):
    with pytest.raises(UserError, match="would be grouped-query attention"):
        parse_space(sweep_cfg(tiny_data, tmp_path, '"model.n_head" = { choice = [2, 4] }', "n_kv_head = 2"))
    parse_space(
        sweep_cfg(tiny_data, tmp_path, '"model.n_head" = { choice = [2, 4] }', "n_kv_head = 1")
    )  # GQA meant


def test_every_choice_combination_is_checked_before_the_sweep_starts(tiny_data, tmp_path):
    """d_model 64 with 3 heads is invalid although each value is valid beside the base's other."""
    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8)
    text = config.read_text().replace('preset = "tiny"', 'preset = "tiny"\nd_model = 96')
    config.write_text(
        text + '"model.d_model" = { choice = [96, 64] }\n"model.n_head" = { choice = [2, 3] }\n'
    )
    proc = run_cli("sweep", str(config), "--storage", str(tmp_path / "s"), timeout=120)
    assert_user_error(proc, "model.d_model=64, model.n_head=3", "not divisible")
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- what transfers


def model_cfg(tmp_path: Path, *overrides: str) -> RayExperiment:
    """The µP proxy of the transfer tests (d_model 64, 2 heads of 32), or a target from it."""
    base = [
        "model.preset=tiny",
        "model.vocab_size=384",
        "model.seq_len=32",
        "model.mup_base_width=64",
        f'data.dir="{tmp_path / "nodata"}"',
        "train.batch_size=4",
        "train.max_steps=16",
    ]
    return load_config(None, [*base, *overrides], cls=RayExperiment)


WIDE = ["model.d_model=256", "model.n_head=8"]


@pytest.mark.parametrize(
    "target, needle",
    [
        (["model.n_layer=3"], "model.n_layer: 2 vs 3"),
        (["model.n_head=4"], "d_head (d_model / n_head): 32 vs 64; give the target n_head = 8"),
        (["model.vocab_size=512"], "model.vocab_size: 384 vs 512"),
        (["model.seq_len=64"], "model.seq_len: 32 vs 64"),
        (['optim.schedule="wsd"'], "optim.schedule: cosine vs wsd"),
        (["optim.beta2=0.99"], "optim.beta2: 0.95 vs 0.99"),
        (["train.batch_size=8"], "tokens per step"),
        (["resources.workers=2"], "tokens per step"),
        (["model.n_kv_head=4"], "query heads per KV head: 1 vs 2"),
        (["model.d_ff=512"], "d_ff / d_model: 4 vs 2"),
        (["model.mup_base_width=128"], "model.mup_base_width: 64 vs 128"),
    ],
)
def test_what_mup_does_not_transfer_is_refused(tmp_path, target, needle):
    proxy = model_cfg(tmp_path)
    space = parse_space(apply_overrides(proxy, {"sweep.space": {"lr": {"loguniform": [1e-4, 1e-2]}}}))
    check_transferable(proxy, model_cfg(tmp_path, *WIDE), space)  # the plain target passes
    with pytest.raises(UserError, match="differ in what µP does not transfer") as err:
        check_transferable(proxy, model_cfg(tmp_path, *WIDE, *target), space)
    assert needle in str(err.value)


def test_another_tokenizer_of_the_same_size_is_refused(tiny_data, tmp_path):
    from gptcore.prepare import prepare

    source = tmp_path / "other.txt"
    source.write_text("<|endoftext|>".join(synthetic_documents(seed=1)), encoding="utf-8")
    prepare(inputs=[str(source)], corpus=None, out=str(tmp_path / "other"), vocab_size=384, progress=False)
    proxy = model_cfg(tmp_path, f'data.dir="{tiny_data}"')
    space = parse_space(apply_overrides(proxy, {"sweep.space": {"lr": {"loguniform": [1e-4, 1e-2]}}}))
    check_transferable(proxy, model_cfg(tmp_path, *WIDE, f'data.dir="{tiny_data}"'), space)
    with pytest.raises(UserError, match="tokenizer: the data folders .* use different ones"):
        check_transferable(proxy, model_cfg(tmp_path, *WIDE, f'data.dir="{tmp_path / "other"}"'), space)


def test_searched_optimizer_keys_are_carried_not_compared(tmp_path):
    proxy = model_cfg(tmp_path, "optim.beta2=0.99")
    raw = proxy.to_dict()
    raw["sweep"]["space"] = {"lr": {"loguniform": [1e-4, 1e-2]}, "beta2": {"uniform": [0.9, 0.999]}}
    space = parse_space(experiment_from_dict(raw))
    assert carried_keys(space) == ["optim.lr", "optim.weight_decay", "optim.warmup", "optim.beta2"]
    check_transferable(proxy, model_cfg(tmp_path, *WIDE), space)


# ---------------------------------------------------------------- gptrun transfer on a real sweep


@pytest.fixture(scope="module")
def mup_sweep(tiny_data, tmp_path_factory, shared_ray) -> Path:
    """A real 3-trial µP sweep of the tiny proxy (d_model 64 = the base width, output x2)."""
    folder = tmp_path_factory.mktemp("mup_sweep")
    config = write_sweep_config(tiny_data, folder, n=3, max_steps=16, sweep_keys="max_concurrent = 1")
    mup = 'preset = "tiny"\nmup_base_width = 64\nmup_output_mult = 2.0'
    config.write_text(config.read_text().replace('preset = "tiny"', mup))
    storage = str(folder / "sweeps")
    proc = run_cli("sweep", str(config), "--name", "proxy", "--storage", storage, env=shared_ray, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return folder / "sweeps" / "proxy"


def target_toml(tiny_data: Path, folder: Path, *model: str) -> Path:
    """The 4x wider target (d_model 256, 8 heads of 32) of the sweep's proxy, trained 4x longer;
    `model` lines go into its [model] table."""
    text = tiny_config_text(tiny_data, folder / "run", max_steps=64)
    text = text.replace("max_steps = 12\n", "").replace("warmup = 2\n", "warmup = 0.05\n")
    text = text.replace(
        'preset = "tiny"', "\n".join(['preset = "tiny"', "d_model = 256", "n_head = 8", *model])
    )
    path = folder / "target.toml"
    path.write_text(text)
    return path


def test_transfer_writes_the_target_with_the_proxys_values_and_it_trains(mup_sweep, tiny_data, tmp_path):
    best = load_experiment(mup_sweep / "best.toml")
    out = tmp_path / "big.toml"
    proc = run_cli(
        "transfer", str(mup_sweep), "--to", str(target_toml(tiny_data, tmp_path)), "--out", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "proxy (trial" in proc.stdout and "hidden-matrix lr (lr / m)" in proc.stdout
    assert f"gptrun train {out}" in proc.stdout
    big = load_experiment(out)
    assert (big.optim.lr, big.optim.weight_decay, big.optim.warmup) == (
        best.optim.lr,
        best.optim.weight_decay,
        best.optim.warmup,
    )
    m = big.model
    assert (m.d_model, m.n_head, m.n_kv_head, m.d_ff, m.mup_base_width, m.width_mult) == (
        256,
        8,
        8,
        1024,
        64,
        4.0,
    )
    assert big.train.max_steps == 64 and big.train.out == str(tmp_path / "run")

    train = run_cli(
        "train", str(out), "--local", "--set", "train.max_steps=4", "--set", "train.eval_interval=4"
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_the_horizon_exponent_scales_lr_by_the_token_ratio(mup_sweep, tiny_data, tmp_path):
    """The target trains 64 steps, the proxy 16: exponent 0.5 halves the lr, and says so."""
    best = load_experiment(mup_sweep / "best.toml")
    target = target_toml(tiny_data, tmp_path)
    proc = run_cli("transfer", str(mup_sweep), "--to", str(target), "--horizon-exponent", "0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x0.5 (an empirical rule, not part of µP)" in proc.stdout
    written = load_experiment(mup_sweep / "transfer-target.toml")
    assert written.optim.lr == pytest.approx(best.optim.lr * 0.5, rel=1e-12)


def test_a_target_of_another_depth_is_one_line_and_nothing_is_written(mup_sweep, tiny_data, tmp_path):
    target = target_toml(tiny_data, tmp_path, "n_layer = 3")
    proc = run_cli("transfer", str(mup_sweep), "--to", str(target), "--out", str(tmp_path / "big.toml"))
    assert_user_error(proc, "model.n_layer: 2 vs 3", "µP transfers across width only")
    assert not (tmp_path / "big.toml").exists()


def test_a_sweep_without_mup_is_refused(tiny_data, tmp_path):
    cfg = load_experiment(write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8))
    start_experiment(tmp_path / "sp", cfg, {})
    proc = run_cli("transfer", str(tmp_path / "sp"), "--to", str(target_toml(tiny_data, tmp_path)))
    assert_user_error(proc, "did not use µP", "--set model.mup_base_width=64")
    proc = run_cli("transfer", str(tmp_path / "nothing"), "--to", str(target_toml(tiny_data, tmp_path)))
    assert_user_error(proc, "is not a gptrun sweep folder")


def test_an_out_that_cannot_be_written_or_exists_is_refused(mup_sweep, tiny_data, tmp_path):
    target = str(target_toml(tiny_data, tmp_path))
    proc = run_cli("transfer", str(mup_sweep), "--to", target, "--out", "/proc/gptrun/t.toml")
    assert_user_error(proc, "/proc/gptrun", "not writable")
    out = tmp_path / "mine.toml"
    out.write_text("# the user's own file\n")
    proc = run_cli("transfer", str(mup_sweep), "--to", target, "--out", str(out))
    assert_user_error(proc, f"--out {out} exists", "--force")
    assert out.read_text() == "# the user's own file\n"
    proc = run_cli("transfer", str(mup_sweep), "--to", target, "--out", str(out), "--force")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_experiment(out).model.d_model == 256


def test_relative_paths_are_written_absolute_so_the_config_trains_from_anywhere(
    mup_sweep, tiny_data, tmp_path
):
    """The target names its data, then its starting checkpoint (`train.init_from`), relative to
    where transfer runs; the printed command works elsewhere, as best.toml's does."""
    relative = os.path.relpath(tiny_data, tmp_path)
    target = target_toml(tiny_data, tmp_path)
    target.write_text(target.read_text().replace(f'dir = "{tiny_data}"', f'dir = "{relative}"'))
    out = tmp_path / "big.toml"
    proc = run_cli("transfer", str(mup_sweep), "--to", str(target), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_experiment(out).data.dir == str(tiny_data.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    train = run_cli("train", str(out), "--local", "--set", "train.max_steps=2", cwd=elsewhere)
    assert train.returncode == 0, train.stderr[-3000:]

    text = target.read_text().replace(f'out = "{tmp_path / "run"}"', f'out = "{tmp_path / "tuned"}"')
    target.write_text(text.replace("[train]\n", '[train]\ninit_from = "run/checkpoints/last.pt"\n'))
    tuned = tmp_path / "tuned.toml"
    proc = run_cli("transfer", str(mup_sweep), "--to", str(target), "--out", str(tuned), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_experiment(tuned).train.init_from == str(tmp_path / "run" / "checkpoints" / "last.pt")
    train = run_cli("train", str(tuned), "--local", "--set", "train.max_steps=2", cwd=elsewhere)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "weights from" in train.stdout + train.stderr
