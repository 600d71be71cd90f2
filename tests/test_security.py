"""The local Ray that gptrun starts takes a token that only its owner can read
(`experiments.cluster.private_token`), and refuses a client without it: at its GCS (gptrun's
probe, `ray.init`) and at the dashboard's job API (`ray job submit`). A password written into a
URL of the config leaves it as the config is read (`experiments.credentials`; the sweep against
a real PostgreSQL whose files hold no password: tests/test_backends.py). A cluster with Ray's TLS
is joined with its certificates, and named as such without them."""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from benchmarks.kill_anywhere import kill_sweep
from experiments.cluster import AUTH_SETTINGS, ray_session
from experiments.ray_config import RayExperiment, load_experiment
from gptcore.errors import UserError
from tests.conftest import REPO, assert_user_error, free_ports, run_cli, tiny_config_text, write_sweep_config
from tests.test_cluster import wait_for

PROBE = "from experiments.cluster import check_cluster; check_cluster({address!r})"
TASK = "import ray; ray.init(address={address!r}); print(ray.get(ray.remote(lambda: 'ran').remote()))"


def listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def client(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_the_local_ray_takes_a_token_only_its_owner_can_read(tmp_path, monkeypatch):
    for name in ("RAY_ADDRESS", *AUTH_SETTINGS):  # a local Ray of this test's own, no token chosen
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "owner"))  # where Ray would write its own token
    outsider = {k: v for k, v in os.environ.items() if k not in AUTH_SETTINGS}
    outsider.update(HOME=str(tmp_path / "outsider"), PYTHONPATH=str(REPO), GPTRUN_RESOURCE_WAIT_S="10")
    with ray_session():
        import ray

        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
        assert os.environ["RAY_AUTH_MODE"] == "token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600, oct(token.stat().st_mode)
        assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700, oct(token.parent.stat().st_mode)
        address = ray.get_runtime_context().gcs_address
        refused = client(PROBE.format(address=address), outsider)
        assert refused.returncode != 0 and "refused this client" in refused.stderr, refused.stderr[-2000:]
        no_token = client(TASK.format(address=address), outsider)
        assert no_token.returncode != 0 and "ran" not in no_token.stdout, no_token.stdout[-2000:]
        owner = {**outsider, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        accepted = client(TASK.format(address=address), owner)
        assert accepted.returncode == 0 and "ran" in accepted.stdout, accepted.stderr[-2000:]
        jobs = f"http://{ray._private.worker.get_dashboard_url()}/api/jobs/"  # `ray job submit`'s API
        with pytest.raises(urllib.error.HTTPError) as refused_job:
            urllib.request.urlopen(urllib.request.Request(jobs, data=b"{}", method="POST"), timeout=30)
        assert refused_job.value.code == 401, refused_job.value
    assert not token.exists() and not token.parent.exists()  # removed with the Ray it opened
    assert not (tmp_path / "owner" / ".ray" / "auth_token").exists()  # Ray wrote no token of its own
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ


def load_with(tiny_data: Path, tmp_path: Path, **urls: str) -> RayExperiment:
    config = tmp_path / "c.toml"
    config.write_text(tiny_config_text(tiny_data, tmp_path / "run"))
    return load_experiment(config, [f'{key.replace("__", ".")}="{url}"' for key, url in urls.items()])


def test_a_password_in_a_database_url_moves_to_pgpassword(tiny_data, tmp_path, monkeypatch):
    """So that no saved copy of the config holds it (`experiments.credentials`)."""
    monkeypatch.delenv("PGPASSWORD", raising=False)
    cfg = load_with(tiny_data, tmp_path, sweep__storage_url="postgresql://team:s3cret@db:5432/studies")
    assert cfg.sweep.storage_url == "postgresql://team@db:5432/studies"
    assert os.environ["PGPASSWORD"] == "s3cret" and "s3cret" not in str(cfg.to_dict())
    again = load_with(tiny_data, tmp_path, sweep__storage_url="postgresql://team@db:5432/studies")
    assert again.sweep.storage_url == "postgresql://team@db:5432/studies"  # nothing to move


def test_a_password_in_an_mlflow_server_url_moves_to_mlflows_variables(tiny_data, tmp_path, monkeypatch):
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_with(tiny_data, tmp_path, tracking__mlflow_uri="https://me:tok3n@mlflow.lab:5000/")
    assert cfg.tracking.mlflow_uri == "https://mlflow.lab:5000/"
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("me", "tok3n")


def test_a_password_no_variable_can_carry_is_refused(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("PGPASSWORD", "other")
    cases = [
        ("sweep__storage_url", "mysql+pymysql://u:pw@db/studies", "give it to the mysql client another way"),
        ("sweep__storage_url", "postgresql://u:pw@db/studies", "$PGPASSWORD holds another"),
    ]
    for key, url, needle in cases:
        with pytest.raises(UserError, match=re.escape(needle)):
            load_with(tiny_data, tmp_path, **{key: url})


def test_a_tls_cluster_is_joined_with_its_certificates_and_named_without_them(tiny_data, tmp_path):
    """A Ray head started with Ray's TLS (self-signed certificates made here) and a token: a sweep
    with RAY_USE_TLS and the certificate files set runs on it; without them it is one line
    saying that the head uses TLS (gptrun's probe), not "not a Ray head"."""
    from ray._common.tls_utils import generate_self_signed_tls_certs

    cert, key = generate_self_signed_tls_certs()
    (tmp_path / "cert.pem").write_text(cert)
    (tmp_path / "key.pem").write_text(key)
    token = tmp_path / "token"
    token.write_text("a" * 64)
    token.chmod(0o600)
    pem = str(tmp_path / "cert.pem")
    tls = {"RAY_USE_TLS": "1", "RAY_TLS_CA_CERT": pem, "RAY_TLS_SERVER_CERT": pem}
    tls["RAY_TLS_SERVER_KEY"] = str(tmp_path / "key.pem")
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    (port,) = free_ports(1)
    head_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *AUTH_SETTINGS)} | tls | auth
    ray = Path(sys.executable).with_name("ray")
    ray_tmp = Path(tempfile.mkdtemp(prefix="gptrun-tls-"))  # short: Ray's socket paths must fit
    head = subprocess.Popen(
        [str(ray), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--node-ip-address=127.0.0.1", f"--temp-dir={ray_tmp}", "--dashboard-host=127.0.0.1",
         "--disable-usage-stats"],
        env=head_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        address = f"127.0.0.1:{port}"
        wait_for(lambda: listens(port), 120, "the head's GCS port")
        config = write_sweep_config(tiny_data, tmp_path, n=2, max_steps=8)
        sweep = ["sweep", str(config), "--address", address, "--storage", str(tmp_path / "sweeps")]
        without = run_cli(*sweep, "--name", "plain", env=auth, timeout=300)
        assert_user_error(without, f"the Ray head at --address {address} uses TLS", "RAY_USE_TLS=1")
        with_tls = run_cli(*sweep, "--name", "tls", env=auth | tls, timeout=600)
        assert with_tls.returncode == 0, with_tls.stdout[-3000:] + with_tls.stderr[-3000:]
        assert "best trial" in with_tls.stdout
    finally:
        kill_sweep(head)  # the head and every process of its Ray, by session
        head.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
