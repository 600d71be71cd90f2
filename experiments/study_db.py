"""The database that holds a sweep's Optuna study: sqlite in the experiment folder on one machine,
a server (PostgreSQL) that a team's sweeps share on a cluster, where sqlite's file locking on NFS
is not safe.

Opening it is checked before Ray starts, so a bad URL, a missing driver, a server that refuses
the connection or the credentials is one line naming the fix, not a traceback minutes in. URLs
are shown with their password hidden: they go to the console and into logs.
"""

from __future__ import annotations

import functools
import shlex
import sqlite3
from pathlib import Path
from typing import Any

from gptcore.errors import UserError, first_line

CONNECT_TIMEOUT_S = 10  # an unreachable host fails in seconds, not after the OS's TCP timeout
CHECK_LOGIN = "check the user and password (in the URL, PGPASSWORD or ~/.pgpass)"
HINTS = (  # (what the driver's message says, what to do)
    ("password", CHECK_LOGIN),
    ("authentication", CHECK_LOGIN),
    ("does not exist", "create it first, e.g. `createdb NAME` on the server"),
    ("", "check the host and port, and that the server is running and reachable from here"),
)


def shown_url(url: str) -> str:
    """The URL with its password replaced by ***; a URL that does not parse is shown as given."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL: rdb_storage says what is wrong with it
        return url


def dashboard_command(url: str) -> str:
    """The shell command that opens the study's storage in optuna-dashboard."""
    from sqlalchemy.engine import make_url

    command = f"optuna-dashboard {shlex.quote(shown_url(url))}"
    if make_url(url).password is not None:
        command += "  # password hidden: put it back, or keep it in PGPASSWORD / ~/.pgpass"
    return command


def rdb_storage(url: str, read_only: bool = False) -> Any:
    """An Optuna RDB storage, or one line naming what is wrong with the URL or the server.

    `read_only` is for a storage gptrun only reads (a warm start's source): Optuna creates no
    tables in it, and a sqlite file is opened read-only, so a damaged or empty source is refused
    as it is, not repaired into an empty study. The file is named to sqlite as a percent-encoded
    `file:` URI: spliced in raw, a `#` or `?` in its folder cut the path short, dropped
    `mode=ro`, and sqlite created an empty database where the cut path pointed."""
    import optuna
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    shown = shown_url(url)
    try:
        parsed = make_url(url)
        backend = parsed.get_backend_name()
    except (sqlalchemy.exc.ArgumentError, ValueError) as err:
        raise UserError(
            f"sweep.storage_url {shown}: not a database URL ({first_line(err)}); write it as "
            "postgresql://USER@HOST:5432/DB or sqlite:////abs/path/optuna.db"
        ) from None
    kwargs: dict[str, Any] = {}
    if backend == "postgresql":
        kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    elif backend == "sqlite" and read_only and parsed.database:
        ro_uri = f"{Path(parsed.database).resolve().as_uri()}?mode=ro"
        kwargs["creator"] = functools.partial(sqlite3.connect, ro_uri, uri=True)
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_table_creation=read_only)
    except ImportError as err:  # Optuna wraps the driver's ModuleNotFoundError
        name = getattr(err.__cause__, "name", None) or err.name or "its driver"
        fix = "pip install 'gptrun[postgres]'" if backend == "postgresql" else f"pip install {name}"
        raise UserError(f"sweep.storage_url {shown}: needs the database driver {name!r}: {fix}") from None
    except sqlalchemy.exc.ArgumentError as err:  # an unknown dialect or driver name
        raise UserError(f"sweep.storage_url {shown}: {first_line(err)}; check the URL's scheme") from None
    except sqlalchemy.exc.OperationalError as err:
        reason = first_line(err.orig or err)
        hint = next(fix for needle, fix in HINTS if needle in reason.lower())
        raise UserError(f"sweep.storage_url {shown}: cannot connect ({reason}); {hint}") from None
    except Exception as err:  # SQLAlchemy and Optuna raise many more types (schema, versions)
        raise UserError(
            f"sweep.storage_url {shown}: cannot open the Optuna storage "
            f"({type(err).__name__}: {first_line(err)})"
        ) from None
