"""No password stays in a config: one written into `sweep.storage_url` (PostgreSQL) or
`tracking.mlflow_uri` is moved, as the config is read, to the environment variable its client
reads, and the URL keeps the rest. So no copy of the config holds it: not `gptrun.toml`,
`best.toml`, a checkpoint (which saves its config), Tune's saved state (which pickles the
trainable's config and the searcher's storage), a log line or the report.

    postgresql://user:PASSWORD@host/db     ->  PGPASSWORD (libpq: psycopg, optuna, mlflow)
    http(s)://user:PASSWORD@mlflow-server  ->  MLFLOW_TRACKING_USERNAME / _PASSWORD

The command that read it runs with the password in its environment, and so does the local Ray it
starts; a later command on the same sweep (`resume`, `confirm`, `report`) reads the saved config,
which has none: it needs PGPASSWORD, `~/.pgpass` or MLFLOW_TRACKING_PASSWORD set (docs/cluster.md).
A password for another database is refused in one line, as its client has no such variable.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from gptcore.errors import UserError

if TYPE_CHECKING:
    from experiments.ray_config import RayExperiment


def without_passwords(cfg: RayExperiment) -> RayExperiment:
    """`cfg` with the passwords of its URLs moved to the environment."""
    storage = _database_url(cfg.sweep.storage_url, "sweep.storage_url")
    mlflow = cfg.tracking.mlflow_uri
    if urlsplit(mlflow).scheme in ("http", "https"):
        mlflow = _http_url(mlflow)
    elif "://" in mlflow:
        mlflow = _database_url(mlflow, "tracking.mlflow_uri")
    if (storage, mlflow) == (cfg.sweep.storage_url, cfg.tracking.mlflow_uri):
        return cfg
    return replace(
        cfg,
        sweep=replace(cfg.sweep, storage_url=storage),
        tracking=replace(cfg.tracking, mlflow_uri=mlflow),
    )


def _database_url(url: str, key: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url) if url else None
    except Exception:  # not a URL: `rdb_storage` says what is wrong with it
        return url
    if parsed is None or parsed.password is None:
        return url
    if parsed.get_backend_name() != "postgresql":
        raise UserError(
            f"{key} holds a password, which gptrun would save with the sweep; write the URL "
            f"without it and give it to the {parsed.get_backend_name()} client another way"
        )
    _move_to_env("PGPASSWORD", str(parsed.password), key)
    return parsed._replace(password=None).render_as_string(hide_password=False)


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    _move_to_env("MLFLOW_TRACKING_USERNAME", parts.username or "", "tracking.mlflow_uri")
    _move_to_env("MLFLOW_TRACKING_PASSWORD", parts.password, "tracking.mlflow_uri")
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def _move_to_env(name: str, value: str, key: str) -> None:
    held = os.environ.get(name)
    if held is not None and held != value:
        raise UserError(
            f"{key} holds a password and ${name} holds another; write the URL without its "
            f"password and keep the one in ${name} (or ~/.pgpass)"
        )
    os.environ[name] = value
