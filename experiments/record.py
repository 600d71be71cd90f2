"""The record of each sweep trial's life, kept in the sweep's Optuna study.

A sweep has three bookkeepers: Tune's experiment state (snapshotted every second or so, and
uploaded in the background to object storage), the Optuna study, and `events.jsonl`. A driver
killed between a trial's end and Tune's next snapshot used to resume from an older picture: the
trial ran again and got another result, while the study kept the first one. One of them has to
be the authority, written before anything acts on a fact or announces it; the study is the one:

- it is transactional (sqlite in the experiment folder, or PostgreSQL for a team): a fact is
  durable the moment it is written, and a kill cannot leave half a write;
- it is written first: Tune asks the searcher for a trial before creating it, and tells the
  searcher a trial's end before the callbacks announce it;
- TPE, warm starts, optuna-dashboard and the importance plot read it already, so a fourth
  record would be one more thing to keep in step.

What each Optuna trial of the sweep holds (warm-start copies carry `warm_start_from` instead):

    params                its sampled values, from the moment it is asked
    tune_trial_id         the Tune trial that runs it (a resume can hand it to a new one)
    continues             the Tune trials that ran it before that, oldest first (a killed driver
                          had started it after Tune's last snapshot): their checkpoints are its
    config                its sampled values as Tune's trial config (what the tables show)
    intermediate values   its val loss at each evaluation, keyed by tokens seen
    status, final         how it ended (`experiments.outcome`) and its last report, written just
                          before its Optuna state, so a kill between the two still leaves its end
    state, value          RUNNING until it ends, then COMPLETE / PRUNED / FAIL

`gptrun resume` reconciles Tune to it (`experiments.study`, `experiments.trial`): an ended trial
stays ended with its result; a trial asked but never saved by Tune is run under a new Tune trial,
from the newest checkpoint it wrote under the old one.
The report, `confirm`, `transfer` and warm starts read each trial's status and result from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TUNE_ID, CONFIG, STATUS, FINAL = "tune_trial_id", "config", "status", "final"
CONTINUES = "continues"
WARM_FROM = "warm_start_from"  # a trial copied from another sweep's study (`warm_start`)
# What a trial's record keeps of its last report: what the tables, the report and a replay need.
FINAL_KEYS = (
    "tokens",
    "step",
    "loss",
    "val_loss",
    "best_val_loss",
    "val_bpb",
    "time_total_s",
    "node_id",
    "checkpoint_path",
    "fit_start_unix",
    "report_unix",
    "reason",
    "error",
    "diverged",
    "refused",
)


@dataclass
class TrialRecord:
    """One sweep trial as its study holds it."""

    number: int  # the Optuna trial number
    tune_id: str  # the Tune trial that runs it ('' if the driver was killed before saying)
    state: str  # Optuna's: RUNNING, COMPLETE, PRUNED, FAIL
    status: str = ""  # how it ended (`experiments.outcome.STATUSES`); '' while it runs
    final: dict[str, Any] = field(default_factory=dict)  # its last report
    config: dict[str, Any] = field(default_factory=dict)
    continues: list[str] = field(default_factory=list)  # Tune trials that ran it before `tune_id`

    @property
    def ended(self) -> bool:
        return bool(self.status) or self.state != "RUNNING"


def final_result(result: dict[str, Any] | None) -> dict[str, Any]:
    """What the record keeps of a trial's last report (JSON values; NaN is kept as NaN)."""
    result = result or {}
    return {k: result[k] for k in FINAL_KEYS if k in result and isinstance(result[k], (int, float, str))}


def record_of(trial: Any) -> TrialRecord:
    """A `TrialRecord` from an Optuna `FrozenTrial`."""
    attrs = trial.user_attrs
    return TrialRecord(
        number=trial.number,
        tune_id=attrs.get(TUNE_ID, ""),
        state=trial.state.name,
        status=attrs.get(STATUS, ""),
        final=attrs.get(FINAL, {}),
        config=attrs.get(CONFIG, {}),
        continues=attrs.get(CONTINUES, []),
    )


def own_trials(study: Any) -> list[Any]:
    """The study's trials that this sweep asked (not warm-start copies), oldest first."""
    return [t for t in study.get_trials(deepcopy=False) if WARM_FROM not in t.user_attrs]


def read_records(url: str, name: str) -> dict[str, TrialRecord]:
    """Tune trial id -> record, for every trial sweep `name` asked in the study at `url`; empty
    where there is no such study (a confirm run, a sqlite file on another machine). Opens
    nothing for writing: a missing sqlite file is not created."""
    import optuna
    from sqlalchemy.engine import make_url

    from experiments.study_db import rdb_storage

    if url.startswith("sqlite:") and not Path(make_url(url).database or "").is_file():
        return {}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=name, storage=rdb_storage(url))
    except KeyError:
        return {}
    records = [record_of(t) for t in own_trials(study)]
    return {r.tune_id: r for r in records if r.tune_id}


def replay_result(record: TrialRecord, penalty: float) -> dict[str, Any]:
    """The report that ends a trial again after a resume, as it ended before the kill: its last
    report, or (a trial that died without one) an error scored like one."""
    result = dict(record.final)
    if "val_loss" not in result or not math.isfinite(result["val_loss"]):
        result["val_loss"] = penalty
    if record.status == "error":
        result.setdefault("error", 1.0)
    return {**result, "replayed": 1.0}
