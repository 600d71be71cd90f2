"""A real, throwaway PostgreSQL server for the tests: Debian's `postgresql` binaries (installed by
`make test` when missing), `initdb` in a temp folder, `pg_ctl start` on a free loopback port,
stopped and removed at the end.

initdb refuses to run as root, so under root the server runs as the `postgres` user (created by
the Debian package) or `nobody`, via `runuser`, in a temp folder that user owns. The superuser
`gptrun` has a password and TCP logins need it (scram-sha-256), so wrong credentials are refused
as on a real server. Anything that stops the server from starting fails the test with the reason:
these tests must exercise a server, never skip it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_ports

USER, PASSWORD = "gptrun", "team-secret"


@dataclass(frozen=True)
class Postgres:
    port: int

    def url(self, password: str | None = None, port: int | None = None) -> str:
        """A URL for the `postgres` database; no password in it unless given (PGPASSWORD is)."""
        auth = f"{USER}:{password}" if password is not None else USER
        return f"postgresql://{auth}@127.0.0.1:{port or self.port}/postgres"

    @property
    def env(self) -> dict[str, str]:
        """What a client needs beside the URL: the password the way libpq reads it."""
        return {"PGPASSWORD": PASSWORD}


def bindir() -> Path:
    """Where initdb and pg_ctl are: `pg_config --bindir`, Debian's versioned folder, or PATH."""
    candidates = []
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True)
        candidates.append(out.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True)
    found = shutil.which("initdb")
    candidates += [str(Path(found).resolve().parent)] if found else []
    for folder in candidates:
        if (Path(folder) / "initdb").is_file() and (Path(folder) / "pg_ctl").is_file():
            return Path(folder)
    raise RuntimeError(
        "no PostgreSQL server binaries (initdb, pg_ctl): `make test` installs Debian's postgresql "
        "package as root; elsewhere run `apt-get install postgresql`"
    )


def _version(folder: str) -> int:
    name = Path(folder).parent.name
    return int(name) if name.isdigit() else 0


def _as_server_user() -> tuple[list[str], pwd.struct_passwd | None]:
    """The command prefix that drops root for initdb and the server (none when not root)."""
    if os.geteuid() != 0:
        return [], None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            user = pwd.getpwnam(name)
            return ["runuser", "-u", name, "--"], user
    raise RuntimeError("running as root and neither a `postgres` nor a `nobody` user exists for initdb")


def _run(cmd: list[str], what: str, log: Path | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        extra = log.read_text()[-2000:] if log and log.exists() else ""
        raise RuntimeError(f"PostgreSQL {what} failed ({proc.returncode}): {proc.stderr[-2000:]}\n{extra}")


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    """A running server for the duration of the block; stopped (fast shutdown) and deleted after."""
    bins = bindir()
    prefix, user = _as_server_user()
    root = Path(tempfile.mkdtemp(prefix="gptrun-pg-"))  # under /tmp: reachable by the server user
    data, log, pwfile = root / "data", root / "server.log", root / "pwfile"
    pwfile.write_text(PASSWORD + "\n")
    if user is not None:
        for path in (root, pwfile):
            os.chown(path, user.pw_uid, user.pw_gid)
    (port,) = free_ports(1)
    initdb = [str(bins / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}"]
    initdb += ["--auth-host=scram-sha-256", "--auth-local=trust", "--no-locale", "-E", "UTF8", "--no-sync"]
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
    pg_ctl = [*prefix, str(bins / "pg_ctl"), "-D", str(data)]
    try:
        _run([*prefix, *initdb], "initdb")
        _run([*pg_ctl, "-o", options, "-l", str(log), "-w", "-t", "60", "start"], "start", log)
        try:
            yield Postgres(port)
        finally:
            _run([*pg_ctl, "-m", "fast", "-w", "-t", "60", "stop"], "stop", log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
