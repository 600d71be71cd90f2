"""`gptrun plan`: ASHA arithmetic and the printed plan, with a real throughput probe."""

from __future__ import annotations

from experiments.plan import asha_rungs, expected_tokens
from tests.conftest import assert_user_error, run_cli, write_sweep_config


def test_asha_rungs_and_expected_tokens():
    assert asha_rungs(100, 1000, 3) == [100, 300, 900, 1000]
    assert asha_rungs(1000, 1000, 2) == [1000]
    # 9 trials reach 100 tokens, 3 go on to 300, 1 to 900 (then 1000).
    assert expected_tokens(9, [100, 300, 900, 1000], 3) == 9 * 100 + 3 * 200 + 1 * 600 + 100 / 3


def test_plan_prints_the_cost_and_warns_over_budget(tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path, n=6, max_steps=24)
    proc = run_cli("plan", str(config), "--cpus", "4", "--gpus", "0")
    assert proc.returncode == 0, proc.stderr
    # 1 CPU per trial + 0.01 for its Tune driver: 4 CPUs hold 3 trials.
    assert "6, 3 at a time" in proc.stdout and "measured" in proc.stdout
    assert "ASHA rungs   768, 2,304, 3,072 tokens" in proc.stdout
    proc = run_cli("plan", str(config), "--tokens-per-sec", "10", "--set", 'sweep.budget="1m"')
    assert proc.returncode == 0 and "warning: the plan needs" in proc.stdout
    assert_user_error(run_cli("plan", str(config), "--cpus", "0.5"), "one trial needs")
