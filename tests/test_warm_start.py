"""Warm starts and the parallel-aware TPE: a sweep's searcher seeded with an earlier sweep's trials.

The unit tests build the source sweep's study with the sweep's own searcher (`search_config`),
driven by hand with made-up losses (no Ray session: a searcher needs none), and check what a
warm start reads from it. The CLI test warm-starts a real sweep from the session's finished
sweep, kills its driver, resumes it, and reads the study and the report.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import optuna
import pytest

from experiments.experiment import start_experiment, study_url
from experiments.ray_config import RayExperiment, load_experiment
from experiments.record import WARM_FROM
from experiments.space import apply_overrides, parse_space
from experiments.tuner import search_config, tpe_sampler
from experiments.warm_start import history_trials, load_history, start_study
from gptcore.errors import UserError
from tests.conftest import assert_user_error, run_cli, study_trials, write_sweep_config

RELATIVE = "tpe:relative_params:0"  # what TPE's model (not its random start-up) leaves on a trial


def sweep_config(tiny_data: Path, folder: Path, *overrides: str) -> RayExperiment:
    return load_experiment(write_sweep_config(tiny_data, folder, n=4, max_steps=8), list(overrides))


def source_sweep(cfg: RayExperiment, exp_dir: Path, n: int) -> None:
    """An experiment folder whose study holds `n` finished trials, asked and told through the
    sweep's own searcher: losses from a made-up bowl around lr 3e-3, every third trial stopped
    early (PRUNED at its first rung)."""
    cfg = apply_overrides(cfg, {"sweep.baseline": False})
    start_experiment(exp_dir, cfg, {"max_concurrent": 1})
    searcher = search_config(cfg, parse_space(cfg), exp_dir).search_alg
    full = searcher._full_tokens
    for k in range(n):
        tid = f"src{k}"
        config = searcher.suggest(tid)
        loss = 5.0 + abs(config["optim.lr"] - 3e-3) * 100
        if k % 3 == 2:
            searcher.on_trial_complete(tid, {"val_loss": loss + 1, "tokens": full // 4})
        else:
            searcher.on_trial_result(tid, {"val_loss": loss + 1, "tokens": full // 4})
            searcher.on_trial_complete(tid, {"val_loss": loss, "tokens": full})


def trials_of(cfg: RayExperiment, exp_dir: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=exp_dir.name, storage=study_url(cfg, exp_dir)).trials


def test_history_seeds_the_study_once_and_tpe_starts_from_it(tiny_data, tmp_path):
    base = sweep_config(tiny_data, tmp_path)
    source_sweep(base, tmp_path / "sweeps" / "old", n=6)
    cfg = apply_overrides(base, {"sweep.warm_start": "old", "sweep.seed": 7})
    space = parse_space(cfg)
    history = load_history(cfg, space, tmp_path / "sweeps")  # found by name in the storage folder
    assert history is not None and len(history.trials) == 6
    assert "6 trials of" in history.note and "4 completed, 2 stopped early" in history.note
    assert "TPE draws from its model from the first trial" in history.note

    exp_dir = tmp_path / "sweeps" / "new"
    start_experiment(exp_dir, cfg, {"max_concurrent": 2})
    searcher = search_config(cfg, space, exp_dir, history).search_alg
    start_study(study_url(cfg, exp_dir), exp_dir.name, space, 1, history)  # a second time: no copy
    copied = history_trials(study_url(cfg, exp_dir), exp_dir.name)
    old = trials_of(base, tmp_path / "sweeps" / "old")
    assert [(t.params, t.state, t.value, t.intermediate_values) for t in copied] == [
        (t.params, t.state, t.value, t.intermediate_values) for t in old
    ]
    assert {t.user_attrs[WARM_FROM] for t in copied} == {str((tmp_path / "sweeps" / "old").resolve())}
    assert all("tune_trial_id" not in t.user_attrs for t in copied)  # only the new sweep's own

    # Trial 0 is the baseline (its values fixed); the first trial TPE picks comes from its model.
    first = [searcher.suggest("t0"), searcher.suggest("t1")]
    assert first[0]["optim.lr"] == pytest.approx(cfg.optim.lr)
    own = [t for t in trials_of(cfg, exp_dir) if WARM_FROM not in t.user_attrs]
    assert [t.state for t in own] == [optuna.trial.TrialState.RUNNING] * 2  # what constant liar sees
    assert "fixed_params" in own[0].system_attrs and RELATIVE in own[1].system_attrs, own

    # The same sweep cold: its first trials are random start-up ones.
    cold_dir = tmp_path / "sweeps" / "cold"
    cold = apply_overrides(cfg, {"sweep.warm_start": ""})
    start_experiment(cold_dir, cold, {"max_concurrent": 2})
    cold_searcher = search_config(cold, space, cold_dir).search_alg
    cold_searcher.suggest("t0"), cold_searcher.suggest("t1")
    assert not any(RELATIVE in t.system_attrs for t in trials_of(cold, cold_dir))


def test_a_study_name_in_the_shared_database_is_a_source(tiny_data, tmp_path):
    url = f"sqlite:///{tmp_path / 'team.db'}"
    base = sweep_config(tiny_data, tmp_path, f'sweep.storage_url="{url}"')
    source_sweep(base, tmp_path / "elsewhere" / "monday", n=4)
    cfg = apply_overrides(base, {"sweep.warm_start": "monday"})
    history = load_history(cfg, parse_space(cfg), tmp_path / "sweeps")  # no folder: the study
    assert history is not None and len(history.trials) == 4
    assert history.source == f"study 'monday' in {url}"
    assert "TPE draws from its model from the first trial" in history.note  # 4 >= 3 start-up trials


def test_a_different_space_is_refused_naming_what_differs(tiny_data, tmp_path):
    base = sweep_config(tiny_data, tmp_path)
    source_sweep(base, tmp_path / "sweeps" / "old", n=3)
    cases = [
        ("sweep.space.lr={ loguniform = [1e-4, 0.3] }", "optim.lr loguniform [0.0001, 0.3] here, "
         "loguniform [1e-05, 0.3] in"),
        ("sweep.space.beta2=0.99", "optim.beta2 fixed to 0.99 here, not in the space in"),
        ("sweep.space.weight_decay={ loguniform = [1e-3, 0.3] }", "optim.weight_decay loguniform "
         "[0.001, 0.3] here, loguniform [0.001, 0.3] or 0 in"),
    ]  # fmt: skip
    for override, needle in cases:
        cfg = apply_overrides(
            load_experiment(tmp_path / "sweep.toml", [override]), {"sweep.warm_start": "old"}
        )
        with pytest.raises(UserError) as err:
            load_history(cfg, parse_space(cfg), tmp_path / "sweeps")
        assert needle in str(err.value) and "searched another space" in str(err.value), str(err.value)


def test_unknown_and_empty_sources_are_one_line(tiny_data, tmp_path):
    base = sweep_config(tiny_data, tmp_path)
    cfg = apply_overrides(base, {"sweep.warm_start": "nowhere"})
    with pytest.raises(UserError, match="'nowhere' is not a sweep folder"):
        load_history(cfg, parse_space(cfg), tmp_path / "sweeps")
    start_experiment(tmp_path / "sweeps" / "empty", base, {"max_concurrent": 1})
    cfg = apply_overrides(base, {"sweep.warm_start": "empty"})
    with pytest.raises(UserError, match="has no Optuna study"):
        load_history(cfg, parse_space(cfg), tmp_path / "sweeps")
    source_sweep(base, tmp_path / "sweeps" / "old", n=1)
    (tmp_path / "sweeps" / "old").rename(tmp_path / "sweeps" / "renamed")
    cfg = apply_overrides(base, {"sweep.warm_start": "renamed"})
    with pytest.raises(UserError, match="holds no study named 'renamed' \\(was the folder renamed"):
        load_history(cfg, parse_space(cfg), tmp_path / "sweeps")


def test_tpe_options_and_no_experimental_warning(tiny_data, tmp_path):
    cfg = sweep_config(tiny_data, tmp_path)
    space = parse_space(cfg)
    assert space.conditional  # weight_decay's include_zero
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = tpe_sampler(cfg.sweep, space)
    assert (sampler._multivariate, sampler._constant_liar, sampler._group) == (True, True, True)
    plain = apply_overrides(cfg, {"sweep.multivariate": False, "sweep.constant_liar": False})
    sampler = tpe_sampler(plain.sweep, space)
    assert (sampler._multivariate, sampler._constant_liar, sampler._group) == (False, False, False)


def test_cli_refuses_a_different_space_before_ray_starts(tiny_data, tmp_path):
    base = sweep_config(tiny_data, tmp_path)
    source_sweep(base, tmp_path / "sweeps" / "old", n=3)
    proc = run_cli(
        "sweep", str(tmp_path / "sweep.toml"), "--storage", str(tmp_path / "sweeps"),
        "--warm-start", str(tmp_path / "sweeps" / "old"),
        "--set", "sweep.space.warmup={ uniform = [0.0, 0.5] }",
        timeout=120,
    )  # fmt: skip
    assert_user_error(proc, "optim.warmup uniform [0, 0.5] here, uniform [0, 0.3] in", "same [sweep.space]")
    assert not (tmp_path / "sweeps" / "sweep").exists()  # nothing written


def test_warm_started_sweep_from_the_cli_resumes_without_a_second_history(
    finished_sweep, tiny_data, tmp_path
):
    from tests.test_sweep import assert_resumed_study, kill_when_interrupted, study_rows, trial_records

    n, steps, every = 4, 120, 10
    config = write_sweep_config(tiny_data, tmp_path, n=n, max_steps=steps)
    exp_dir = tmp_path / "sweeps" / "warm"
    args = [
        sys.executable, "-m", "experiments", "sweep", str(config), "--name", "warm",
        "--storage", str(tmp_path / "sweeps"), "--warm-start", str(finished_sweep),
        "--set", "sweep.grace_tokens=100000000", "--set", f"train.eval_interval={every}",
    ]  # fmt: skip
    before = kill_when_interrupted(args, exp_dir, steps, every)
    assert any(recs[-1]["step"] < steps for recs in before.values()), before
    proc = run_cli("resume", str(exp_dir), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    source = study_trials(f"sqlite:///{finished_sweep / 'optuna.db'}", finished_sweep.name)
    url = f"sqlite:///{exp_dir / 'optuna.db'}"
    copied = history_trials(url, "warm")
    assert sorted(t.user_attrs["warm_start_trial"] for t in copied) == sorted(tid for tid, _ in source)
    after = trial_records(exp_dir)
    assert len(after) == n and all(recs[-1]["step"] == steps for recs in after.values()), after
    assert_resumed_study(study_rows(exp_dir), after)  # the sweep's own trials, each once
    study = optuna.load_study(study_name="warm", storage=url)
    # Its own trials (a FAIL one was asked by the killed driver before Tune saved it), the
    # baseline aside: each drawn from TPE's model, none from the random start-up.
    own = [t for t in study.trials if "tune_trial_id" in t.user_attrs and t.state.name != "FAIL"]
    picked = [t for t in own if "fixed_params" not in t.system_attrs]
    assert len(picked) == n - 1 and all(RELATIVE in t.system_attrs for t in picked), own

    proc = run_cli("report", str(exp_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"warm start: {len(copied)} trials of {finished_sweep}" in proc.stdout
    page = (exp_dir / "report" / "report.html").read_text()
    assert "Warm start" in page and str(finished_sweep) in page


def test_a_source_is_read_only_even_when_it_is_refused(tiny_data, tmp_path):
    """An empty or damaged source study is refused as it is: no schema is written into it."""
    base = sweep_config(tiny_data, tmp_path)
    source = tmp_path / "sweeps" / "old"
    start_experiment(source, base, {"max_concurrent": 1})
    (source / "optuna.db").write_bytes(b"")
    cfg = apply_overrides(base, {"sweep.warm_start": "old"})
    with pytest.raises(UserError, match="has no Optuna study .*optuna.db is empty"):
        load_history(cfg, parse_space(cfg), tmp_path / "sweeps")
    assert (source / "optuna.db").stat().st_size == 0
    (source / "optuna.db").write_bytes(b"SQLite format 3\x00" + b"\x00" * 84)  # a header, no tables
    before = (source / "optuna.db").read_bytes()
    with pytest.raises(UserError, match="sweep.warm_start: .*old's study cannot be read"):
        load_history(cfg, parse_space(cfg), tmp_path / "sweeps")
    assert (source / "optuna.db").read_bytes() == before


def test_a_good_source_is_read_without_writing_to_it(tiny_data, tmp_path):
    base = sweep_config(tiny_data, tmp_path)
    source_sweep(base, tmp_path / "sweeps" / "old", n=3)
    db = tmp_path / "sweeps" / "old" / "optuna.db"
    before = db.read_bytes()
    cfg = apply_overrides(base, {"sweep.warm_start": "old"})
    assert len(load_history(cfg, parse_space(cfg), tmp_path / "sweeps").trials) == 3
    assert db.read_bytes() == before


def test_a_source_whose_path_holds_uri_characters_is_read_only_too(tiny_data, tmp_path):
    """The read-only sqlite URI is percent-encoded: spliced in raw, `#` cut the path short at
    `tmp_path/a`, where sqlite created an empty database (read-write: `mode=ro` was cut too)."""
    storage = tmp_path / "a#b?c%41" / "sweeps"
    base = sweep_config(tiny_data, tmp_path)
    source_sweep(base, storage / "old", n=3)
    before = (storage / "old" / "optuna.db").read_bytes()
    cfg = apply_overrides(base, {"sweep.warm_start": "old"})
    assert len(load_history(cfg, parse_space(cfg), storage).trials) == 3
    assert (storage / "old" / "optuna.db").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a#b?c%41", "sweep.toml"]
