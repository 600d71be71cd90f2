"""A resumed sweep continues each unfinished trial from the newest checkpoint it wrote.

Tune's saved experiment state names each trial's checkpoints and the one to resume it from, but
it is a snapshot: a trial may have written newer checkpoints since (they are committed to storage
by the trial before it reports them), and Tune deletes a trial's older checkpoints
(`train.keep_checkpoints`) as new ones come, so the state of a driver killed at the wrong moment
can name a checkpoint that is gone ("Could not recover from checkpoint as it does not exist on
storage anymore", and the trial was lost). A trial that a killed driver started after Tune's
last snapshot is not in that state at all: the study hands it to a new Tune trial
(`experiments.study`), and its checkpoints are in the folder of the Tune trial that ran it.

`NewestCheckpoints`, a Tune callback, looks at each unfinished trial when a resumed sweep starts,
and at each trial a resume hands to a new Tune trial as Tune starts it: it forgets the
checkpoints that are gone and resumes the trial from the newest checkpoint folder in its trial
folder, or else in the folders of the Tune trials that ran it before (`experiments.record`,
`continues`), or from step 0 where none is left, with a console line when that is not the one
Tune's state named.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ray.tune import Callback

from experiments.events import announced
from experiments.experiment import append_event, trial_folder_name
from experiments.private_ray import set_trial_checkpoints, trial_checkpoints, trial_folder
from experiments.record import read_records
from experiments.tune_state import checkpoint_folders, checkpoint_index


class NewestCheckpoints(Callback):
    """Checks the restored trials once per run of the experiment (`setup` is called on every
    start, resumes included), on Tune's first step: after it restored them, before it starts
    any, so that their processes number their next checkpoint folders from the right index.
    A trial the study handed to a new Tune trial is checked as Tune starts it, before Tune
    restores it (Ray 2.60.0 `TuneController._actor_started` calls `on_trial_start` first)."""

    def __init__(self, exp_dir: Path, study_url: str) -> None:
        self.exp_dir, self.study_url = exp_dir, study_url
        self.checked: set[str] | None = None  # None until the first step of this run
        self.resumed = False  # that step found trials: a resume

    def setup(self, **info: Any) -> None:
        self.checked = None

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        if self.checked is None:  # the first step: the restored trials, none of them started yet
            self.checked, self.resumed = {trial.trial_id for trial in trials}, bool(trials)
            earlier = self._earlier() if trials else {}
            for trial in trials:
                if trial.status != "TERMINATED":
                    resume_from_newest(trial, earlier.get(trial.trial_id, []))

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if self.checked is None or trial.trial_id in self.checked:
            return
        self.checked.add(trial.trial_id)
        earlier = self._earlier().get(trial.trial_id) if self.resumed else None
        if not earlier:  # a new trial of its own (a sweep that was never stopped has no other)
            return
        if not announced(self.exp_dir, earlier[-1], "continued"):
            event = {"event": "continued", "trial_id": earlier[-1], "as": trial.trial_id, "unix": time.time()}
            append_event(self.exp_dir, event)
            print(
                f"trial {trial.trial_id} runs the values of trial {earlier[-1]}, which the stopped "
                "driver had started after Tune last saved its state",
                flush=True,
            )
        resume_from_newest(trial, earlier)

    def _earlier(self) -> dict[str, list[str]]:
        """Tune trial id -> the Tune trials that ran it before, for each trial of the study."""
        records = read_records(self.study_url, self.exp_dir.name)
        return {tune_id: record.continues for tune_id, record in records.items() if record.continues}


def resume_from_newest(trial: Any, earlier: list[str]) -> None:
    """Make the newest intact checkpoint in `trial`'s folder (none there: in the folder of the
    newest of the `earlier` Tune trials that has one) the one it resumes from (none: step 0),
    and drop its vanished checkpoints from Tune's bookkeeping; say so where Tune's state named
    another."""
    kept, latest = trial_checkpoints(trial)
    fs, folder = trial_folder(trial)
    found, source = _checkpoints(fs, folder), trial.trial_id
    experiment = folder.rsplit("/", 1)[0]
    for trial_id in reversed(earlier):
        if found:
            break
        found, source = _checkpoints(fs, f"{experiment}/{trial_folder_name(trial_id)}"), trial_id
    newest = found[-1] if found else None
    named = _name(latest) if latest else None
    moved = (newest and newest.path) != (latest and latest.path)
    if not moved and [c.path for c in found] == [c.path for c in kept]:
        return  # Tune's state is up to date
    if moved and source != trial.trial_id:
        print(f"trial {trial.trial_id}: resuming it from {_name(newest)} of trial {source}", flush=True)
    elif moved:
        instead = f"resuming it from {_name(newest)}" if newest else "restarting it from step 0"
        print(
            f"trial {trial.trial_id}: Tune's saved state named checkpoint {named or 'none'}, its "
            f"newest on storage is another (the sweep was stopped between the two); {instead}",
            flush=True,
        )
    # The next checkpoint folder follows the newest one (or the one Tune's state had reached).
    own = [checkpoint_index(c.path) for c in found] if source == trial.trial_id else []
    index = max(own + ([checkpoint_index(latest.path)] if latest else [-1]))
    set_trial_checkpoints(trial, found, newest, index)


def _checkpoints(fs: Any, folder: str) -> list[Any]:
    """The intact checkpoints in trial folder `folder`, oldest first, as `ray.tune.Checkpoint`s."""
    from ray.tune import Checkpoint

    return [Checkpoint(path, filesystem=fs) for path in checkpoint_folders(fs, folder)]


def _name(checkpoint: Any) -> str:
    return checkpoint.path.rsplit("/", 1)[1]
