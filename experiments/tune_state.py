"""Tune's view of a sweep, read as plain JSON: nothing saved by Tune is unpickled.

Tune saves each trial's state in `experiment_state-*.json`; some of its fields are cloudpickle
blobs (Tune falls back to pickling what JSON cannot hold), and `tuner.pkl`, `searcher-state-*.pkl`
and `callback-states-*.pkl` are pickles. Unpickling runs code, so whoever can write to the sweep's
folder or bucket could run code as whoever opens it (docs/cluster.md, "Who must be trusted").
`gptrun resume` has to unpickle them (it is Tune resuming); reading a sweep back (`report`,
`confirm`, the summary at the end) does not: a trial's id, status, config and last report are
plain JSON in that file, its reports are JSON lines in its `result.json`, and its checkpoint is
the newest intact checkpoint folder in its trial folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from experiments import remote
from gptcore.checkpoint import CHECKPOINT_FILE

PREFIX = "checkpoint_"  # a trial's checkpoint folders: checkpoint_000000, checkpoint_000001, ...


@dataclass
class TuneTrial:
    trial_id: str
    status: str  # PENDING, RUNNING, PAUSED, TERMINATED, ERROR
    config: dict[str, Any] = field(default_factory=dict)
    last_result: dict[str, Any] = field(default_factory=dict)
    path: str = ""  # its folder, as a user writes it (with the scheme in object storage)
    checkpoint: str = ""  # its newest checkpoint folder, likewise ('' where none)


def read_tune_trials(where: str) -> list[TuneTrial]:
    """The trials of the experiment in folder or URI `where`, from its newest saved state."""
    fs, root = _open(where)
    state = _read_json(fs, _newest_state(fs, root))
    trials = []
    for trial_json, meta_json in state["trial_data"]:
        trial, meta = json.loads(trial_json), json.loads(meta_json)
        folder = f"{root}/{trial['relative_logdir']}"
        checkpoints = checkpoint_folders(fs, folder)
        trials.append(
            TuneTrial(
                trial_id=trial["trial_id"],
                status=trial["status"],
                config=_plain(trial.get("config")),
                last_result=_plain(meta.get("last_result")),
                path=remote.shown_path(folder, fs),
                checkpoint=remote.shown_path(checkpoints[-1], fs) if checkpoints else "",
            )
        )
    return trials


def read_reports(where: str, trial: TuneTrial) -> list[dict[str, Any]]:
    """Every report of `trial`, from its `result.json` (a last line cut short by a killed driver
    is left out)."""
    fs, root = _open(where)
    folder = trial.path.rsplit("/", 1)[1]
    try:
        with fs.open_input_stream(f"{root}/{folder}/result.json") as f:
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except (FileNotFoundError, OSError):
        return []
    reports = []
    for line in lines:
        try:
            reports.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return reports


def _open(where: str) -> tuple[Any, str]:
    import pyarrow.fs

    if remote.is_uri(where):
        return remote.filesystem(where)
    return pyarrow.fs.LocalFileSystem(), where


def _newest_state(fs: Any, root: str) -> str:
    from pyarrow.fs import FileSelector

    found = [
        f.path for f in fs.get_file_info(FileSelector(root)) if f.base_name.startswith("experiment_state-")
    ]
    if not found:
        raise FileNotFoundError(f"no experiment_state-*.json in {root}")
    return max(found)


def _read_json(fs: Any, path: str) -> dict[str, Any]:
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())


def _plain(value: Any) -> dict[str, Any]:
    """A dict field of Tune's state, without the values Tune pickled (never unpickled here)."""
    if not isinstance(value, dict):
        return {}
    return {
        k: v
        for k, v in value.items()
        if not (isinstance(v, dict) and v.get("_type") == "CLOUDPICKLE_FALLBACK")
    }


def checkpoint_folders(fs: Any, folder: str) -> list[str]:
    """The intact checkpoint folders (holding a checkpoint file) in trial folder `folder`,
    oldest first ([]: no such folder)."""
    from pyarrow.fs import FileSelector, FileType

    if fs.get_file_info(folder).type != FileType.Directory:
        return []
    found = [
        info.path
        for info in fs.get_file_info(FileSelector(folder))
        if info.type == FileType.Directory
        and info.base_name.removeprefix(PREFIX).isdigit()
        and fs.get_file_info(f"{info.path}/{CHECKPOINT_FILE}").type == FileType.File
    ]
    return sorted(found, key=checkpoint_index)


def checkpoint_index(path: str) -> int:
    return int(path.rsplit("/", 1)[1].removeprefix(PREFIX))
