"""The tier marks of tests/conftest.py: what a test uses decides its tier."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, run_cli, tier_of, tiny_config_text, write_sweep_config

# Stand-ins for tests and fixtures: read, never run.


def reads_a_config(tmp_path):
    from gptcore.config import load_config

    return load_config(None, ["train.max_steps=2"])


def trains(tiny_data, tmp_path):
    from gptcore.train import Trainer

    path = tmp_path / "exp.toml"
    path.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    Trainer(reads_a_config(tmp_path)).fit()


def trains_through_a_helper(tiny_data, tmp_path):
    trains(tiny_data, tmp_path)


def refuses_a_bad_config(tmp_path):
    return run_cli("plan", str(tmp_path / "missing.toml"))


def trains_with_the_cli(tmp_path):
    return run_cli("train", str(tmp_path / "exp.toml"), "--local")


def trains_on_ray_with_the_cli(tmp_path):
    return run_cli("train", str(tmp_path / "exp.toml"))


def sweeps(tiny_data, tmp_path):
    config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8)
    return run_cli("sweep", str(config), "--storage", str(tmp_path))


def starts_a_ray():
    import ray

    ray.init(num_cpus=1)
    yield
    ray.shutdown()


def kills_a_sweep(tiny_data, tmp_path):
    import signal
    import subprocess
    import sys

    driver = subprocess.Popen([sys.executable, "-m", "experiments", "sweep", str(tmp_path)], cwd=REPO)
    driver.send_signal(signal.SIGKILL)


@pytest.mark.parametrize(
    "functions, marks, tier",
    [
        ([reads_a_config, pytest.approx], [], "fast"),  # only this folder's code is read
        ([refuses_a_bad_config], [], "fast"),
        ([trains], [], "train"),
        ([trains_through_a_helper], [], "train"),  # what its helpers use counts
        ([trains_with_the_cli], [], "train"),
        ([trains_on_ray_with_the_cli], [], "ray"),
        ([reads_a_config, starts_a_ray], [], "ray"),  # what its fixtures use counts
        ([sweeps, trains], [], "ray"),  # the most expensive thing it uses
        ([kills_a_sweep], [], "system"),
        ([reads_a_config], ["slow", "parametrize"], "system"),
    ],
)
def test_a_test_is_in_the_tier_of_the_most_expensive_thing_it_uses(functions, marks, tier):
    assert tier_of(functions, marks) == tier


def test_every_collected_test_has_exactly_one_tier(request):
    tiers = {"fast", "train", "ray", "system"}
    for item in request.session.items:
        assert len(tiers & {mark.name for mark in item.iter_markers()}) == 1, item.nodeid


def test_a_test_on_a_shared_sweep_is_in_the_ray_tier_at_least(request):
    """`finished_sweep` builds its command line in a list (`run_cli(*args)`): the code alone
    did not show a sweep, and its tests ran in `fast`, the sweep in their set-up (64 s). The
    tests of this session are checked, as above."""
    for item in (i for i in request.session.items if "finished_sweep" in i.fixturenames):
        assert item.get_closest_marker("ray") or item.get_closest_marker("system"), item.nodeid
