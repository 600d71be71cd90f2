"""The Optuna study of a sweep, live in its storage from the first trial.

`StudySearch` is Ray's `OptunaSearch` given an RDB storage (sqlite in the experiment folder, or
`sweep.storage_url`): every trial is written as it is asked and told, so a sweep killed and never
resumed still leaves every finished trial in the study, and optuna-dashboard can watch a running
sweep. It adds what Ray's searcher leaves out:
- each Optuna trial carries its Tune trial id (user attribute `tune_trial_id`);
- intermediate values are keyed by tokens seen, which survive a restore (Tune's iteration
  counter restarts at 1 after one); every evaluation is one, the last included: Tune hands the
  result that ends a trial (the one ASHA stopped it on, or its full-budget one) to
  `on_trial_complete` only, so it is recorded there before the trial is told;
- a trial that ends before its full token budget (ASHA stopped it, or the sweep's time budget
  ran out) is told as PRUNED with its intermediate values, not as COMPLETE with a partial loss,
  so TPE, the importance plot and the dashboard treat it as what it is.
Diverged and failed runs report a bad finite loss and are told COMPLETE with it, so that TPE
learns to avoid their region.

A killed driver can have told the study about a trial that Tune's last saved state still holds as
running: on resume Tune runs that trial on from its checkpoint, and its reports and end are then
skipped here (the study already has them), so no trial is told twice.
"""

from __future__ import annotations

from typing import Any

from ray.tune.search.optuna import OptunaSearch

from experiments.private_api import optuna_study, optuna_trials, told_trials
from experiments.storage import rdb_storage, shown_url
from gptcore.errors import UserError

TUNE_ID = "tune_trial_id"


class StudySearch(OptunaSearch):
    def __init__(self, *, full_tokens: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._full_tokens = full_tokens
        self._reported: dict[str, int] = {}  # trial id -> last tokens reported to Optuna

    def suggest(self, trial_id: str) -> dict | None:
        params = super().suggest(trial_id)
        if trial_id in optuna_trials(self):
            optuna_trials(self)[trial_id].set_user_attr(TUNE_ID, trial_id)
        return params

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id in told_trials(self) or trial_id not in optuna_trials(self):
            return
        self._record(trial_id, result)

    def _record(self, trial_id: str, result: dict) -> None:
        """One evaluation as the intermediate value at its token count. Skipped: a replayed
        report after a restore (no more tokens than the last one), a report without a loss, and
        the bad score of a failed or diverged run (a verdict, not a point of its curve)."""
        tokens = int(result.get("tokens", 0))
        if self.metric not in result or tokens <= self._reported.get(trial_id, 0):
            return
        if result.get("error") or result.get("diverged"):
            return
        from optuna.exceptions import UpdateFinishedTrialError

        try:
            optuna_trials(self)[trial_id].report(result[self.metric], tokens)
        except UpdateFinishedTrialError:  # told before the driver was killed: see the module doc
            told_trials(self).add(trial_id)
            return
        self._reported[trial_id] = tokens

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id in told_trials(self) or trial_id not in optuna_trials(self):
            return super().on_trial_complete(trial_id, result, error)
        import optuna

        failed = error or not result or self.metric not in result
        if not failed:
            self._record(trial_id, result)  # the result that ended it reached no on_trial_result
            if trial_id in told_trials(self):  # told by a killed driver: see the module doc
                return
        if (
            failed
            or result.get("error")
            or result.get("diverged")
            or result.get("tokens", 0) >= self._full_tokens
        ):
            state = optuna.trial.TrialState.FAIL if failed else optuna.trial.TrialState.COMPLETE
            value = None if failed else result[self.metric]
        else:  # Optuna gives a PRUNED trial the value of its last report: the one just recorded
            state, value = optuna.trial.TrialState.PRUNED, None
        optuna_study(self).tell(optuna_trials(self)[trial_id], value, state=state, skip_if_finished=True)
        told_trials(self).add(trial_id)


def check_new_study(url: str, name: str, replace: bool) -> None:
    """A new sweep never takes over another study: a study of this name in a shared database
    is refused unless `--restart` asked to replace this experiment (then only it is deleted)."""
    import optuna

    storage = rdb_storage(url)
    names = {s.study_name for s in optuna.get_all_study_summaries(storage)}
    if name not in names:
        return
    if not replace:
        raise UserError(
            f"the Optuna storage {shown_url(url)} already holds a study named {name!r}; pick "
            "another --name, or pass --restart to replace that experiment"
        )
    optuna.delete_study(study_name=name, storage=storage)


def close_running(url: str, name: str, known: set[str], cut: set[str]) -> None:
    """Close the trials a finished sweep left RUNNING in the study. Those whose Tune trial the
    time budget ended (`cut`: Tune tells no searcher about them) are PRUNED, like ASHA's stops.
    Those whose Tune trial is not in the experiment (`known`) were asked by a driver killed
    before Tune saved them (Tune asks again for a new trial on resume): FAIL, so that no trial
    looks as if it were still running."""
    import optuna

    study = optuna.load_study(study_name=name, storage=rdb_storage(url))
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        tune_id = trial.user_attrs.get(TUNE_ID)
        if tune_id in cut:
            study.tell(trial.number, state=optuna.trial.TrialState.PRUNED)
        elif tune_id not in known:
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
