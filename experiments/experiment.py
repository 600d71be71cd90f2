"""An experiment folder: the files that make a folder a gptrun sweep (or a confirm run inside
one), in one place for the code that writes them and the code that reads them back.

    gptrun.toml    the base config                 sweep.json    how to resume it (width, trial length)
    optuna.db      the Optuna study (sqlite)        events.jsonl  trial starts, ends, ASHA stops
    runs/          Ray Train runs of DDP trials     best.toml     the winner, ready to train
    <trial dirs>   Tune's, one per trial (results and, for 1-worker trials, checkpoints)

An experiment in object storage has the same files under its URI; the driver reads and writes
them in a local working copy and uploads each file it writes (`experiments.remote`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from experiments import remote
from experiments.ray_config import RayExperiment, load_experiment
from experiments.sizing import trial_tokens
from gptcore.atomic import write_text_atomic
from gptcore.errors import UserError

CONFIG_FILE, META_FILE, STUDY_FILE = "gptrun.toml", "sweep.json", "optuna.db"
EVENTS_FILE, BEST_FILE, RUNS_DIR = "events.jsonl", "best.toml", "runs"


def start_experiment(exp_dir: Path, cfg: RayExperiment, meta: dict[str, Any]) -> None:
    """Write the base config and `sweep.json` (how to resume, and a trial's length in tokens, which tells
    completed trials from stopped ones)."""
    exp_dir.mkdir(parents=True, exist_ok=True)
    save(exp_dir, CONFIG_FILE, cfg.to_toml())
    save(exp_dir, META_FILE, json.dumps({"trial_tokens": trial_tokens(cfg), **meta}, indent=1))


def save(exp_dir: Path, name: str, text: str) -> None:
    """Write `exp_dir/name` whole (and upload it, for an experiment in object storage)."""
    write_text_atomic(exp_dir / name, text)
    remote.upload(exp_dir, name)


def open_experiment(experiment: str) -> Path:
    """The folder of an experiment given on the command line: a local path, or the working copy
    of a URI (checked first: one line for a missing bucket or refused credentials)."""
    if remote.is_uri(experiment):
        remote.check_bucket(experiment)
        if not remote.exists(experiment):
            raise UserError(f"{experiment} holds nothing; pass the URI that `gptrun sweep` printed")
        return remote.open_working_copy(experiment, pull=True)
    return Path(experiment).expanduser().resolve()


def remove_experiment(exp_dir: Path, uri: str | None = None) -> None:
    """Delete an experiment folder (--restart), and everything under its URI for one in object
    storage (`uri`, or the one its working copy names)."""
    where = uri or remote.location(exp_dir)
    if remote.is_uri(where):
        remote.delete(where)
    if exp_dir.exists():
        shutil.rmtree(exp_dir)


def trial_dirname(trial: Any) -> str:
    """`trial_<id>`: Tune's default folder name spells out every sampled value. Tune pickles this
    function into its saved state by reference, and whoever unpickles that state (`gptrun
    resume`) imports its module: it lives here, beside the other names of the folder, and not
    with the Tuner (which brings Ray Train and torch)."""
    return trial_folder_name(trial.trial_id)


def trial_folder_name(trial_id: str) -> str:
    return f"trial_{trial_id}"


def is_experiment(exp_dir: Path) -> bool:
    return (exp_dir / CONFIG_FILE).exists() and (exp_dir / META_FILE).exists()


def load_base(exp_dir: Path) -> tuple[RayExperiment, dict[str, Any]]:
    """The experiment's base config and its `sweep.json`."""
    if not is_experiment(exp_dir):
        raise UserError(
            f"{exp_dir} is not a gptrun sweep folder (no {CONFIG_FILE} / {META_FILE});"
            " pass the folder that `gptrun sweep` printed"
        )
    return load_experiment(exp_dir / CONFIG_FILE), read_meta(exp_dir)


def read_meta(exp_dir: Path) -> dict[str, Any]:
    """The experiment's `sweep.json`; one line if it is not a JSON object, or has no per-trial
    length in tokens (which tells completed trials from stopped ones): a damaged folder."""
    path = exp_dir / META_FILE
    meta = parse_meta(path.read_text(), path)
    if not (isinstance(meta.get("trial_tokens"), int) and meta["trial_tokens"] > 0):
        raise _damaged(path, f"trial_tokens is {meta.get('trial_tokens')!r}, not a positive integer")
    return meta


def parse_meta(text: str, where: Path | str) -> dict[str, Any]:
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        meta = err
    if not isinstance(meta, dict):
        raise _damaged(where, f"not a JSON object: {meta}")
    return meta


def _damaged(where: Path | str, problem: str) -> UserError:
    return UserError(
        f"{where} is damaged ({problem}); restore it from a copy of the sweep, or start the sweep "
        "again with --restart"
    )


def saved_meta(exp_dir: Path, uri: str | None = None) -> dict[str, Any]:
    """The `sweep.json` an experiment holds (under `uri` for one in object storage), {} if none."""
    text = remote.read_text(f"{uri}/{META_FILE}") if uri else None
    if uri is None and (exp_dir / META_FILE).exists():
        text = (exp_dir / META_FILE).read_text()
    return parse_meta(text, f"{uri}/{META_FILE}" if uri else exp_dir / META_FILE) if text else {}


def study_url(cfg: RayExperiment, exp_dir: Path) -> str:
    """Where the Optuna study lives: `sweep.storage_url`, or sqlite in the experiment folder (its
    path percent-encoded: SQLAlchemy reads `?` as the start of the query, `%41` as `A`)."""
    from sqlalchemy.engine import URL

    if cfg.sweep.storage_url:
        return cfg.sweep.storage_url
    path = str((exp_dir / STUDY_FILE).resolve())
    return URL.create("sqlite", database=path).render_as_string(hide_password=False)


def append_event(exp_dir: Path, event: dict[str, Any]) -> None:
    """One line of `events.jsonl`. Written by the sweep driver only, so appends do not race."""
    with open(exp_dir / EVENTS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")
    remote.upload_soon(exp_dir, EVENTS_FILE)  # in batches: an object store has no append


def read_events(exp_dir: Path) -> list[dict[str, Any]]:
    """Every event written so far; a line cut short by a killed driver is skipped."""
    path = exp_dir / EVENTS_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
