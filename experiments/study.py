"""The Optuna study of a sweep, live in its storage from the first trial, and the record of
each trial's life (`experiments.record` says what it holds and why it is the authority).

`StudySearch` is Ray's `OptunaSearch` given an RDB storage (sqlite in the experiment folder, or
`sweep.storage_url`). It adds what Ray's searcher leaves out:
- each Optuna trial carries its Tune trial id and its config, written as it is asked;
- intermediate values are keyed by tokens seen, which survive a restore (Tune's iteration
  counter restarts at 1 after one); every evaluation is one, the last included: Tune hands the
  result that ends a trial (the one ASHA stopped it on, or its full-budget one) to
  `on_trial_complete` only, so it is recorded there before the trial is told;
- a trial's end is told by the one outcome rule (`experiments.outcome`): COMPLETE, PRUNED (ASHA
  stopped it) or FAIL (an error, which says nothing about its hyperparameters), with its status
  and last report;
- on a resume (`restore`), Tune's saved state may be older than the study: the trials the study
  saw end are not told again (`gptrun resume` ends their Tune trials with the recorded result,
  see `experiments.trial`), a half-told end is finished, and the trials asked after Tune's last
  snapshot are handed to the next new Tune trials, so that they run instead of being dropped,
  each from the newest checkpoint it wrote under its old Tune trial (`continues`);
- it limits how many trials run at once itself (`set_max_concurrency`), from the trials the study
  and Tune's restored trials say are running. Ray's `ConcurrencyLimiter` keeps its own set of
  running trials, saved in a file of its own: a kill during an upload to object storage can leave
  that file older than Tune's trials, and the limiter then drops the end of a trial it does not
  list (found by CI: a finished trial recorded as "cut by budget") and waits for one it lists
  that will never end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from experiments.outcome import ended_status, study_verdict
from experiments.private_optuna import storage_trial_id
from experiments.private_ray import optuna_study, optuna_trials, told_trials
from experiments.record import CONFIG, CONTINUES, FINAL, STATUS, TUNE_ID, final_result, own_trials, record_of
from experiments.study_db import rdb_storage, shown_url
from gptcore.errors import UserError

# Why a trial ended as Tune's error: the trial function reports every error it catches with its
# reason (`experiments.trial`), so Tune tells one only once the retries of its FailureConfig are
# spent on a trial that raised past that (or whose process died), without a result.
TUNE_ERROR = (
    "ended by an error on each try Tune gave it (most often its process or node was lost, e.g. "
    "killed for memory): see error.txt in its trial folder"
)


class StudySearch(OptunaSearch):
    def __init__(self, *, full_tokens: int, num_samples: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._full_tokens, self._num_samples = full_tokens, num_samples
        self._reported: dict[str, int] = {}  # trial id -> last tokens reported to Optuna
        self._orphans: list[tuple[int, list[str]]] = []  # trials Tune never saved: (storage id,
        # the Tune trials that ran them, oldest first)
        self._resumed = False  # restored from Tune's saved state (`restore`)
        self._last: dict[str, dict] = {}  # trial id -> its last report (what an error keeps)
        self._max_concurrent: int | None = None  # trials at once (`set_max_concurrency`)
        self._live: set[str] = set()  # the Tune trials running now

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        """Limit the trials at once here: True tells Ray's ConcurrencyLimiter to pass everything
        through (see the module's docstring for why)."""
        self._max_concurrent = max_concurrent
        return True

    def suggest(self, trial_id: str) -> dict | str | None:
        import optuna

        if self._max_concurrent and len(self._live) >= self._max_concurrent:
            return None  # Tune asks again once one ends
        study, trials = optuna_study(self), optuna_trials(self)
        if trial_id not in trials:
            if self._orphans:  # asked by a killed driver after Tune's last snapshot: run it now
                storage_id, earlier = self._orphans.pop(0)
                trials[trial_id] = optuna.Trial(study, storage_id)
                # Its checkpoints are in their folders (`NewestCheckpoints`).
                trials[trial_id].set_user_attr(CONTINUES, earlier)
            elif self._resumed and self._asked(study) >= self._num_samples:
                return Searcher.FINISHED  # some ended between Tune's last snapshot and the kill
        params = super().suggest(trial_id)
        trials[trial_id].set_user_attr(TUNE_ID, trial_id)
        trials[trial_id].set_user_attr(CONFIG, params)
        self._live.add(trial_id)
        return params

    def restore(self, checkpoint_path: str) -> None:
        """Tune's saved searcher (as old as Tune's last snapshot), reconciled to the study and to
        the trials Tune restored. Those are read from Tune's saved state beside the searcher's
        (`checkpoint_path`), not from the searcher's own list: the two are separate files, and a
        kill during their upload to object storage can leave either one newer."""
        super().restore(checkpoint_path)
        import optuna

        from experiments.tune_state import read_tune_trials

        restored = {t.trial_id: t.status for t in read_tune_trials(str(Path(checkpoint_path).parent))}
        study, handles = optuna_study(self), optuna_trials(self)
        self._orphans, self._resumed, self._live = [], True, set()
        # The sampler's random state is as old as the snapshot too: it would draw again the
        # values of the trials asked since (and TPE's random start-up draws from it alone).
        study.sampler.reseed_rng()
        for trial in own_trials(study):
            record = record_of(trial)
            if record.state == "RUNNING" and record.status:  # killed between status and tell
                state, value = study_verdict(record.status, record.final)
                study.tell(trial.number, value, state=optuna.trial.TrialState[state], skip_if_finished=True)
            if record.ended:
                told_trials(self).add(record.tune_id)
            elif record.tune_id not in restored:  # asked after Tune's last snapshot
                earlier = record.continues + [record.tune_id] if record.tune_id else record.continues
                self._orphans.append((storage_trial_id(trial), earlier))
            elif restored[record.tune_id] != "TERMINATED":  # Tune runs it on: its reports come here
                handles[record.tune_id] = optuna.Trial(study, storage_trial_id(trial))
                self._live.add(record.tune_id)
            # else Tune ended it untold (the sweep's budget): `close_unfinished` records it

    @staticmethod
    def _asked(study: Any) -> int:
        """How many trials this sweep has asked (an enqueued baseline not yet asked is WAITING)."""
        return sum(t.state.name != "WAITING" for t in own_trials(study))

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id in told_trials(self) or trial_id not in optuna_trials(self):
            return
        self._last[trial_id] = final_result(result)
        self._record(trial_id, result)

    def _record(self, trial_id: str, result: dict) -> None:
        """One evaluation as the intermediate value at its token count. Skipped: a replayed
        report after a restore (no more tokens than the last one), a report without a loss, and
        the bad score of a failed or diverged run (a verdict, not a point of its curve)."""
        tokens = int(result.get("tokens", 0))
        if self.metric not in result or tokens <= self._reported.get(trial_id, 0):
            return
        if result.get("error") or result.get("diverged") or result.get("refused") or result.get("replayed"):
            return
        optuna_trials(self)[trial_id].report(result[self.metric], tokens)  # a replayed token count
        self._reported[trial_id] = tokens  # after a resume overwrites the same value

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self._live.discard(trial_id)
        if trial_id in told_trials(self):  # recorded already: a resume replayed its end
            return
        if trial_id not in optuna_trials(self):
            return super().on_trial_complete(trial_id, result, error)
        import optuna

        if result and not error:
            self._record(trial_id, result)  # the result that ended it reached no on_trial_result
        status = ended_status(None if error else result, self._full_tokens)
        final = final_result({**self._last.pop(trial_id, {}), "reason": TUNE_ERROR} if error else result)
        trial = optuna_trials(self)[trial_id]
        trial.set_user_attr(FINAL, final)
        trial.set_user_attr(STATUS, status)  # the end is recorded from here on
        state, value = study_verdict(status, final)
        optuna_study(self).tell(trial, value, state=optuna.trial.TrialState[state], skip_if_finished=True)
        told_trials(self).add(trial_id)


def check_new_study(url: str, name: str, *, restart: bool, replace: bool, owner: dict[str, Any]) -> None:
    """A new sweep never takes over another study. A study of this name in a shared database is
    refused, unless `--restart` replaces the experiment that created it (`owner`: that
    experiment's `sweep.json` names this database and study) or `--replace-study` says to delete
    it anyway. Deletes nothing: `delete_study` does, once every other check has passed."""
    import optuna

    storage = rdb_storage(url)
    names = {s.study_name for s in optuna.get_all_study_summaries(storage)}
    if name not in names:
        return
    if not restart:
        raise UserError(
            f"the Optuna storage {shown_url(url)} already holds a study named {name!r}; pick "
            "another --name, or pass --restart to replace that experiment"
        )
    ours = owner.get("study_url") == shown_url(url) and owner.get("study_name") == name
    if not ours and not replace:
        raise UserError(
            f"the Optuna storage {shown_url(url)} holds a study named {name!r} that this experiment "
            "folder did not create (a teammate's sweep of the same name?); pick another --name, or "
            "pass --replace-study to delete that study too"
        )


def delete_study(url: str, name: str) -> None:
    """Delete study `name` if it exists (a --restart whose checks have all passed)."""
    import optuna

    storage = rdb_storage(url)
    if name in {s.study_name for s in optuna.get_all_study_summaries(storage)}:
        optuna.delete_study(study_name=name, storage=storage)


def close_unfinished(url: str, name: str, cut: dict[str, dict[str, Any]]) -> None:
    """End the trials that a finished sweep left RUNNING in its study. Those the sweep's budget
    ended (`cut`: Tune trial id -> last report; Tune tells no searcher about them) are "cut by
    budget", PRUNED like ASHA's stops; a trial asked that never ran (the budget ended the sweep
    first) is an error."""
    import optuna

    study = optuna.load_study(study_name=name, storage=rdb_storage(url))
    for trial in own_trials(study):
        record = record_of(trial)
        if record.ended:
            continue
        last = cut.get(record.tune_id)
        status = "cut by budget" if last is not None else "error"
        final = final_result(last) if last is not None else {"reason": "not run: the sweep ended first"}
        handle = optuna.Trial(study, storage_trial_id(trial))
        handle.set_user_attr(FINAL, final)
        handle.set_user_attr(STATUS, status)
        state, value = study_verdict(status, final)
        study.tell(trial.number, value, state=optuna.trial.TrialState[state], skip_if_finished=True)
