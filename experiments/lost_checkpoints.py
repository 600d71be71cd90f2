"""A resumed sweep whose saved state names checkpoints that are gone from storage.

Tune saves its experiment state (which names each trial's checkpoints and the one to resume it
from) every few checkpoints, and deletes a trial's older checkpoints (`train.keep_checkpoints`) as
new ones come. In object storage the state is uploaded in the background, so a driver killed at
the wrong moment leaves a state that names a checkpoint it had already deleted: Tune's resume
then fails that trial twice ("Could not recover from checkpoint as it does not exist on storage
anymore") and the sweep loses it, and deleting a vanished checkpoint later logs a traceback.

`LostCheckpoints`, a Tune callback, looks at each unfinished trial when a (resumed) sweep starts,
before Tune runs any: it forgets the checkpoints that are gone and, where the one to resume from
is gone, resumes the trial from the newest checkpoint folder still in its trial folder (or from
step 0 where none is left), with a console line.
"""

from __future__ import annotations

from typing import Any

from ray.tune import Callback

from experiments.private_api import set_trial_checkpoints, trial_checkpoints
from gptcore.checkpoint import CHECKPOINT_FILE

PREFIX = "checkpoint_"  # a trial's checkpoint folders: checkpoint_000000, checkpoint_000001, ...


class LostCheckpoints(Callback):
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
                    forget_lost_checkpoints(trial)


def forget_lost_checkpoints(trial: Any) -> None:
    """Drop `trial`'s vanished checkpoints from Tune's bookkeeping; if the one it would resume
    from is gone, point it at the newest one left (or none) and say so."""
    kept, latest = trial_checkpoints(trial)
    if latest is None:
        return
    fs = latest.filesystem
    present = [c for c in kept if _holds_checkpoint(fs, c.path)]
    if _holds_checkpoint(fs, latest.path):
        if len(present) < len(kept):
            set_trial_checkpoints(trial, present, latest, _index(latest.path))
        return
    from pyarrow.fs import FileSelector, FileType
    from ray.tune import Checkpoint

    folder = latest.path.rsplit("/", 1)[0]
    known = {c.path for c in present}
    present += [
        Checkpoint(info.path, filesystem=fs)
        for info in fs.get_file_info(FileSelector(folder))
        if info.type == FileType.Directory
        and info.base_name.removeprefix(PREFIX).isdigit()
        and info.path not in known
        and _holds_checkpoint(fs, info.path)
    ]
    present.sort(key=lambda c: _index(c.path))
    newest = present[-1] if present else None
    lost = latest.path.rsplit("/", 1)[1]
    instead = f"resuming it from {newest.path.rsplit('/', 1)[1]}" if newest else "restarting it from step 0"
    print(
        f"trial {trial.trial_id}: its last checkpoint {lost} is gone from storage (the sweep was "
        f"stopped while Tune replaced it); {instead}",
        flush=True,
    )
    set_trial_checkpoints(trial, present, newest, _index(newest.path) if newest else _index(latest.path))


def _holds_checkpoint(fs: Any, path: str) -> bool:
    from pyarrow.fs import FileType

    return fs.get_file_info(f"{path}/{CHECKPOINT_FILE}").type == FileType.File


def _index(path: str) -> int:
    return int(path.rsplit("/", 1)[1].removeprefix(PREFIX))
