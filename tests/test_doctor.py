"""`gptrun doctor` and the fences around private names: every fenced name is present in the
pinned versions, a missing one is one line naming it (never a silent fallback), and a cluster's
nodes are checked too."""

from __future__ import annotations

import socket

import pytest

from experiments import cluster, doctor, private_ray
from experiments.cli import main
from gptcore.errors import UserError
from gptcore.fence import Private, missing, require
from tests.conftest import run_cli

GONE = Private("ray._raylet", "NoSuchLoader", "ray 2.60.0", "tests/test_doctor.py")


def test_every_fenced_name_is_present_in_the_installed_versions():
    assert missing(doctor.fenced()) == []
    assert len({entry.dotted for entry in doctor.fenced()}) == len(doctor.fenced())


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        (GONE, "no NoSuchLoader"),
        (Private("ray._no_such_module", "x", "ray 2.60.0", "t"), "module ray._no_such_module not importable"),
        (Private("ray.tune.search.optuna", "OptunaSearch.self._gone", "ray 2.60.0", "t"), "no self._gone"),
        (
            Private("ray.autoscaler._private.monitor", '"--no-such-flag"', "ray 2.60.0", "t"),
            '"--no-such-flag"',
        ),
    ],
)
def test_a_missing_name_is_one_line_naming_it_the_version_and_the_test(entry, why):
    problem = entry.problem()
    assert problem is not None and "\n" not in problem
    assert (
        problem.startswith(entry.dotted)
        and why in problem
        and entry.checked in problem
        and entry.test in problem
    )
    with pytest.raises(UserError, match=why):
        require(entry)


def test_a_missing_token_loader_is_an_error_not_a_request_without_a_token(monkeypatch):
    """Before the fence, a Ray without the loader sent no token and said nothing."""
    monkeypatch.setattr(private_ray, "TOKEN_LOADER", GONE)
    listening = socket.create_server(("127.0.0.1", 0))  # something answers: the token is next
    with listening, pytest.raises(UserError, match="ray._raylet.NoSuchLoader"):
        cluster.check_cluster(f"127.0.0.1:{listening.getsockname()[1]}")


def test_doctor_fails_in_one_line_per_missing_name(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "RAY_NAMES", [*private_ray.FENCED, GONE])
    monkeypatch.setattr(doctor, "compile_probe", lambda: ("torch.compile: not probed", None))
    monkeypatch.setattr(doctor, "precision_probe", lambda: "precision: not probed")
    assert doctor.run_doctor(None) == 1
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if line.startswith("problem:")]
    assert problems == [f"problem: {GONE.problem()}"]
    assert f"{len(doctor.fenced()) - 1}/{len(doctor.fenced())} present" in out


def test_a_malformed_address_is_refused_before_the_probes(monkeypatch, capsys):
    probed: list[str] = []
    monkeypatch.setattr(doctor, "compile_probe", lambda: probed.append("compile") or ("", None))
    assert main(["doctor", "--address", "not an address"]) == 2
    err = capsys.readouterr().err
    assert "is not 'auto', 'host:port'" in err and len(err.strip().splitlines()) == 1, err
    assert probed == []


def test_doctor_passes_here():
    proc = run_cli("doctor", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout and "torch.compile: works" in proc.stdout
    assert "precision auto -> " in proc.stdout


def test_doctor_checks_every_node_of_a_cluster(shared_ray):
    proc = run_cli("doctor", "--address", shared_ray["RAY_ADDRESS"], env=shared_ray, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "node(s) alive" in proc.stdout and "all checks passed" in proc.stdout
