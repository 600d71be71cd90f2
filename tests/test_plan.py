"""`gptrun plan` and the search space: ASHA arithmetic, the printed plan with a real throughput probe,
the shipped configs, and what TPE puts in a trial's config."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from experiments.cli import build_parser, finite, main
from experiments.ray_config import load_experiment
from experiments.sizing import asha_rungs, concurrency, expected_tokens, trial_bundles, trial_resources
from experiments.space import parse_space
from gptcore.errors import UserError
from tests.conftest import assert_user_error, run_cli, write_sweep_config

CONFIGS = Path(__file__).parent.parent / "experiments" / "configs"
SHIPPED = sorted(CONFIGS.glob("*.toml"))
# mup-target is trained, not swept: `gptrun transfer` fills it from a sweep of mup-proxy;
# scale-series is a `gptrun scale` series (tests/test_scale.py plans it)
SWEPT = [p for p in SHIPPED if p.stem not in ("mup-target", "scale-series")]


def test_asha_rungs_and_expected_tokens():
    """By hand: 9 trials train to the first rung at 100 tokens (900 tokens); a third of them, 3,
    go on to 300 (600 more); 1 goes on to 900 (600 more); a third of a trial on to 1000 (33 1/3
    more): 2133 1/3 tokens in all. With 2 trials and a factor of 2: 2 x 500 + 1 x 500 = 1500."""
    assert asha_rungs(100, 1000, 3) == [100, 300, 900, 1000]
    assert asha_rungs(1000, 1000, 2) == [1000]
    assert expected_tokens(9, [100, 300, 900, 1000], 3) == pytest.approx(2133.3333333333)
    assert expected_tokens(2, [500, 1000], 2) == 1500


def test_plan_prints_the_cost_and_warns_over_budget(tiny_data, tmp_path, capsys):
    """The measured probe as a user runs it; the rest in this process (the subprocesses cost
    seconds each, which the fast tier does not have)."""
    config = write_sweep_config(tiny_data, tmp_path, n=6, max_steps=24)
    proc = run_cli("plan", str(config), "--cpus", "4", "--gpus", "0")
    assert proc.returncode == 0, proc.stderr
    # A 1-worker trial trains in its own Tune process with 1 CPU: 4 CPUs hold 4 trials.
    assert "6, 4 at a time" in proc.stdout and "measured" in proc.stdout
    assert "ASHA rungs   768, 2,304, 3,072 tokens" in proc.stdout
    assert main(["plan", str(config), "--tokens-per-sec", "10", "--set", 'sweep.budget="1m"']) == 0
    assert "warning: the plan needs" in capsys.readouterr().out
    budget = 'sweep.budget="61440 tokens"'  # 20 trials of 3,072 tokens; ASHA's 6 need fewer
    assert main(["plan", str(config), "--tokens-per-sec", "10", "--set", budget]) == 0
    out = capsys.readouterr().out
    assert "budget       61440 tokens (20.0 full trials' worth): fits (" in out, out
    assert main(["plan", str(config), "--cpus", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "one trial needs" in err and len(err.strip().splitlines()) == 1, err


def test_trials_may_share_a_gpu() -> None:
    """resources.gpus_per_worker = 0.5: two one-worker trials on one GPU (benchmarks/gpu.sh runs
    such a sweep), each reserving half of it from Ray."""
    cfg = load_experiment(CONFIGS / "quickstart.toml", ["resources.gpus_per_worker=0.5"])
    assert concurrency(cfg, cpus=16, gpus=1) == 2
    assert trial_resources(cfg) == {"cpu": 1, "gpu": 0.5}
    assert trial_bundles(cfg) == [{"CPU": 1, "GPU": 0.5}]


@pytest.mark.parametrize("config", SWEPT, ids=[p.stem for p in SWEPT])
def test_every_shipped_config_loads_sweeps_and_plans(config: Path) -> None:
    cfg = load_experiment(config)
    space = parse_space(cfg)
    assert space.params and space.baseline(cfg)  # its own values lie inside its sweep space
    proc = run_cli("plan", str(config), "--tokens-per-sec", "100000", "--cpus", "64", "--gpus", "8")
    assert proc.returncode == 0, proc.stderr
    assert "wall-clock" in proc.stdout and "error" not in proc.stderr


def test_plan_refuses_a_baseline_outside_the_space(tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8)
    proc = run_cli("plan", str(config), "--tokens-per-sec", "10", "--set", "optim.warmup=0.9")
    assert_user_error(proc, "lies outside its sweep.space range")


def test_a_zero_chosen_by_tpe_is_in_the_trial_config(tiny_data, tmp_path):
    """Tune's progress table looks up every searched key in the best trial's config: a weight
    decay of exactly 0 (include_zero) must be there as 0.0, not missing (it crashed a sweep)."""
    from ray._private.dict import unflattened_lookup
    from ray.tune.search.optuna import OptunaSearch

    cfg = load_experiment(write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8))
    space = parse_space(cfg)
    zero_wd = {**space.baseline(cfg), "optim.weight_decay_is_zero": True}
    zero_wd.pop("optim.weight_decay")
    search = OptunaSearch(space=space.suggest, points_to_evaluate=[zero_wd], metric="val_loss", mode="min")
    config = search.suggest("t0")
    assert config["optim.weight_decay"] == 0.0 and config["optim.weight_decay_is_zero"] is True
    assert unflattened_lookup("optim.weight_decay", config) == 0.0
    assert space.overrides(config)["optim.weight_decay"] == 0.0


def test_the_mup_target_is_its_proxy_made_wider() -> None:
    """The config pair that docs/mup.md sweeps and transfers: the same depth and head width, the
    target 4x as wide, both in µP with the proxy's width as the base."""
    proxy, target = (load_experiment(CONFIGS / f"mup-{k}.toml") for k in ("proxy", "target"))
    assert proxy.model.mup_base_width == target.model.mup_base_width == proxy.model.d_model
    assert target.model.d_model == 4 * proxy.model.d_model and target.model.n_layer == proxy.model.n_layer
    assert target.model.d_model // target.model.n_head == proxy.model.d_model // proxy.model.n_head


def test_every_float_option_and_the_budget_refuse_inf_and_nan():
    """float() takes 'inf' and 'nan', and they pass an option's own range check ('nan < 0' is
    false): `plan --cpus nan` was a traceback, `--tokens-per-sec inf` a plan of no time at all."""
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    typed = [(sub.prog, a.type) for sub in subcommands.choices.values() for a in sub._actions if a.type]
    assert [prog for prog, kind in typed if kind is float] == []
    assert sum(kind is finite for _, kind in typed) >= 10
    config = str(CONFIGS / "quickstart.toml")
    proc = run_cli("plan", config, "--cpus", "nan")
    assert_user_error(proc, "argument --cpus: nan must be a finite number")
    proc = run_cli("plan", config, "--tokens-per-sec", "inf")
    assert_user_error(proc, "argument --tokens-per-sec: inf must be a finite number", "gptrun plan --help")
    with pytest.raises(UserError, match="must be a positive, finite duration"):
        load_experiment(config, [f'sweep.budget="{"9" * 400}h"'])
