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

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from experiments import remote
from gptcore.checkpoint import CHECKPOINT_FILE
from gptcore.errors import UserError

PREFIX = "checkpoint_"  # a trial's checkpoint folders: checkpoint_000000, checkpoint_000001, ...


@dataclass
class TuneTrial:
    trial_id: str
    status: str  # PENDING, RUNNING, PAUSED, TERMINATED, ERROR
    config: dict[str, Any]
    last_result: dict[str, Any]
    fs: Any = field(repr=False)  # the pyarrow filesystem of the experiment
    folder: str = ""  # its trial folder inside `fs`

    @property
    def path(self) -> str:
        """Its folder, as a user writes it (with the scheme in object storage)."""
        return remote.shown_path(self.folder, self.fs)

    def newest_checkpoint(self) -> str:
        """Its newest intact checkpoint folder, as a user writes it ('' where none)."""
        found = checkpoint_folders(self.fs, self.folder)
        return remote.shown_path(found[-1], self.fs) if found else ""

    def reports(self) -> list[dict[str, Any]]:
        """Every report, from its `result.json` (a last line cut short by a killed driver is
        left out)."""
        try:
            with self.fs.open_input_stream(f"{self.folder}/result.json") as f:
                lines = f.read().decode("utf-8", errors="replace").splitlines()
        except OSError:  # FileNotFoundError included: no report yet
            return []
        reports = []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                reports.append(json.loads(line))
        return reports


def read_tune_trials(where: str) -> list[TuneTrial]:
    """The trials of the experiment in folder or URI `where`, from its newest saved state: one
    line naming that file where it is not the JSON Tune writes (cut short by a full disk or an
    interrupted copy, edited by hand)."""
    fs, root = remote.open_location(where)
    path = _newest_state(fs, root)
    with fs.open_input_stream(path) as f:
        text = f.read()
    try:
        return [_trial(json.loads(t), json.loads(m), fs, root) for t, m in json.loads(text)["trial_data"]]
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # each a shape JSON can take
        raise UserError(
            f"Tune's saved state {remote.shown_path(path, fs)} is damaged ({type(err).__name__}: "
            f"{err}); restore the sweep's folder from a copy, or start the sweep again with --restart"
        ) from None


def _trial(trial: dict[str, Any], meta: dict[str, Any], fs: Any, root: str) -> TuneTrial:
    """One trial of the state's `trial_data`: its trial's JSON and its run metadata's JSON."""
    return TuneTrial(
        trial_id=trial["trial_id"],
        status=trial["status"],
        config=_plain(trial.get("config")),
        last_result=_plain(meta.get("last_result")),
        fs=fs,
        folder=f"{root}/{trial['relative_logdir']}",
    )


def _newest_state(fs: Any, root: str) -> str:
    from pyarrow.fs import FileSelector

    found = [
        f.path for f in fs.get_file_info(FileSelector(root)) if f.base_name.startswith("experiment_state-")
    ]
    if not found:
        raise FileNotFoundError(f"no experiment_state-*.json in {root}")
    return max(found)


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
