"""A resumed sweep continues each unfinished trial from the newest checkpoint it wrote.

Tune's saved experiment state names each trial's checkpoints and the one to resume it from, but
it is a snapshot: a trial may have written newer checkpoints since (they are committed to storage
by the trial before it reports them), and Tune deletes a trial's older checkpoints
(`train.keep_checkpoints`) as new ones come, so the state of a driver killed at the wrong moment
can name a checkpoint that is gone ("Could not recover from checkpoint as it does not exist on
storage anymore", and the trial was lost).

`NewestCheckpoints`, a Tune callback, looks at each unfinished trial when a (resumed) sweep
starts, before Tune runs any: it forgets the checkpoints that are gone and resumes the trial from
the newest checkpoint folder in its trial folder (or from step 0 where none is left), with a
console line when that is not the one Tune's state named.
"""

from __future__ import annotations

from typing import Any

from ray.tune import Callback

from experiments.private_api import set_trial_checkpoints, trial_checkpoints, trial_folder
from gptcore.checkpoint import CHECKPOINT_FILE

PREFIX = "checkpoint_"  # a trial's checkpoint folders: checkpoint_000000, checkpoint_000001, ...


class NewestCheckpoints(Callback):
    """Checks the trials once per run of the experiment (`setup` is called on every start,
    resumes included), on Tune's first step: after it restored them, before it starts any."""

    checked = False

    def setup(self, **info: Any) -> None:
        self.checked = False

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        if not self.checked:  # the first step: the restored trials, none of them started yet
            self.checked = True
            for trial in trials:
                if trial.status != "TERMINATED":
                    resume_from_newest(trial)


def resume_from_newest(trial: Any) -> None:
    """Make the newest intact checkpoint in `trial`'s folder the one it resumes from (none: step
    0), and drop its vanished checkpoints from Tune's bookkeeping; say so where Tune's state named
    another."""
    from pyarrow.fs import FileSelector, FileType
    from ray.tune import Checkpoint

    kept, latest = trial_checkpoints(trial)
    fs, folder = trial_folder(trial)
    if fs.get_file_info(folder).type != FileType.Directory:
        return  # never started
    found = [
        Checkpoint(info.path, filesystem=fs)
        for info in fs.get_file_info(FileSelector(folder))
        if info.type == FileType.Directory
        and info.base_name.removeprefix(PREFIX).isdigit()
        and _holds_checkpoint(fs, info.path)
    ]
    found.sort(key=lambda c: _index(c.path))
    newest = found[-1] if found else None
    named = latest.path.rsplit("/", 1)[1] if latest else None
    moved = (newest and newest.path) != (latest and latest.path)
    if not moved and [c.path for c in found] == [c.path for c in kept]:
        return  # Tune's state is up to date
    if moved:
        instead = (
            f"resuming it from {newest.path.rsplit('/', 1)[1]}" if newest else "restarting it from step 0"
        )
        print(
            f"trial {trial.trial_id}: Tune's saved state named checkpoint {named or 'none'}, its "
            f"newest on storage is another (the sweep was stopped between the two); {instead}",
            flush=True,
        )
    # The next checkpoint folder follows the newest one (or the one Tune's state had reached).
    index = max([_index(c.path) for c in found] + ([_index(latest.path)] if latest else [-1]))
    set_trial_checkpoints(trial, found, newest, index)


def _holds_checkpoint(fs: Any, path: str) -> bool:
    from pyarrow.fs import FileType

    return fs.get_file_info(f"{path}/{CHECKPOINT_FILE}").type == FileType.File


def _index(path: str) -> int:
    return int(path.rsplit("/", 1)[1].removeprefix(PREFIX))
