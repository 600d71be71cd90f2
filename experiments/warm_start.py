"""Warm starts: a sweep whose TPE begins with what an earlier sweep on the same space learned.

`[sweep] warm_start = "NAME"` (or `gptrun sweep --warm-start NAME`) names the earlier sweep: its
experiment folder (a path, or NAME in the sweep's storage folder), or a study of that name in the
sweep's own database (`sweep.storage_url`). Its COMPLETE and PRUNED trials (diverged runs
included: they are COMPLETE with their bad score) are copied into the new study before the first
trial is asked, each tagged with the sweep it came from (user attribute `warm_start_from`). TPE
counts them as its own: its random start-up lasts until the study holds `startup_trials`
finished trials, so with at least that many the very first trial is drawn from TPE's model.

History is evidence about the space it was gathered on only: the earlier sweep must search the
same keys over the same ranges with the same fixed values (read from its gptrun.toml, or from the
space its study records), or the sweep is refused before Ray starts with one line naming what
differs. Its trials may have trained another token budget (a note says so).

The history is copied once, when the study is created; `gptrun resume` restores the searcher with
its study and copies nothing (and a study that already holds a history gets no second one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.experiment import STUDY_FILE, is_experiment, load_base, study_url
from experiments.objective import DIRECTION
from experiments.ray_config import RayExperiment
from experiments.record import TUNE_ID, WARM_FROM
from experiments.sizing import startup_trials, trial_tokens
from experiments.space import Space, parse_space
from experiments.study_db import rdb_storage, shown_url
from gptcore.errors import UserError

WARM_TRIAL = "warm_start_trial"  # a copied trial's Tune trial id in its own sweep
SPACE_ATTR, TOKENS_ATTR = "space", "trial_tokens"  # study user attributes


@dataclass(frozen=True)
class History:
    source: str  # the earlier sweep, as the user reads it
    trials: tuple[Any, ...]  # optuna FrozenTrials, ready to add to the new study
    note: str  # one line for the console


@dataclass(frozen=True)
class _Source:
    label: str
    url: str
    study: str
    space: dict[str, Any]  # Space.record() of the earlier sweep
    trial_tokens: int | None


def load_history(cfg: RayExperiment, space: Space, storage_dir: Path) -> History | None:
    """The earlier sweep's finished trials, checked against this sweep's space (before Ray
    starts); None without `sweep.warm_start`."""
    if not cfg.sweep.warm_start:
        return None
    import optuna

    source = _find(cfg.sweep.warm_start, storage_dir, cfg)
    differences = space_differences(space.record(), source.space, source.label)
    if differences:
        raise UserError(
            f"sweep.warm_start: {source.label} searched another space ({'; '.join(differences)}); "
            "warm-start only from a sweep with the same [sweep.space]"
        )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:  # read-only: the source is another sweep's, and a warm start only reads it
        study = optuna.load_study(study_name=source.study, storage=rdb_storage(source.url, read_only=True))
    except KeyError:  # a renamed folder: its study keeps the name it was created with
        raise UserError(
            f"sweep.warm_start: {shown_url(source.url)} holds no study named {source.study!r} "
            "(was the folder renamed?); warm-start from the folder under its sweep's name"
        ) from None
    except UserError as err:
        raise UserError(f"sweep.warm_start: {source.label}'s study cannot be read: {err}") from None
    finished = study.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    )
    if not finished:
        raise UserError(
            f"sweep.warm_start: {source.label} has no completed or stopped trial yet; let it run "
            "(or resume it) first, or drop warm_start"
        )
    trials = tuple(_copy(t, source.label) for t in finished)
    return History(source.label, trials, _note(cfg, source, finished))


def space_differences(ours: dict[str, Any], theirs: dict[str, Any], source: str) -> list[str]:
    """What differs between two `Space.record()`s, one phrase per key."""
    keys = sorted({*ours["params"], *ours["fixed"], *theirs["params"], *theirs["fixed"]})
    return [
        f"{key} {_describe(ours, key)} here, {_describe(theirs, key)} in {source}"
        for key in keys
        if _entry(ours, key) != _entry(theirs, key)
    ]


def start_study(url: str, name: str, space: Space, tokens: int, history: History | None) -> None:
    """Create the sweep's study with its space recorded (what a later warm start compares),
    and the warm-start history in it, once."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=rdb_storage(url),
        study_name=name,
        direction=DIRECTION,
        load_if_exists=True,
    )
    study.set_user_attr(SPACE_ATTR, space.record())
    study.set_user_attr(TOKENS_ATTR, tokens)
    if history and not any(WARM_FROM in t.user_attrs for t in study.get_trials(deepcopy=False)):
        study.add_trials(history.trials)


def history_trials(url: str, name: str) -> list[Any]:
    """The trials of study `name` that a warm start copied in, in the order they were added."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=rdb_storage(url))
    return [t for t in study.get_trials(deepcopy=False) if WARM_FROM in t.user_attrs]


def report_history(cfg: RayExperiment, exp_dir: Path) -> tuple[list[Any], str]:
    """A sweep's warm-start history for its report: the copied trials, and one line about them
    ('' for a sweep that was not warm-started)."""
    if not cfg.sweep.warm_start:
        return [], ""
    try:
        trials = history_trials(study_url(cfg, exp_dir), exp_dir.name)
    except (KeyError, UserError) as err:  # no study yet, or its server is down
        return [], f"warm start from {cfg.sweep.warm_start}: its trials could not be read ({err})"
    if not trials:
        return [], ""
    sources = ", ".join(sorted({str(t.user_attrs[WARM_FROM]) for t in trials}))
    return trials, (
        f"warm start: {describe(trials, sources)} began this sweep's study: TPE learned from them "
        "before its first trial; they are not in the trial table"
    )


def _find(value: str, storage_dir: Path, cfg: RayExperiment) -> _Source:
    """An experiment folder (as given, or in the storage folder), else a study of this name in
    the sweep's database."""
    for folder in (Path(value).expanduser(), storage_dir / value):
        if not is_experiment(folder):
            continue
        folder = folder.resolve()
        theirs, meta = load_base(folder)
        study_file = folder / STUDY_FILE
        if not theirs.sweep.storage_url and (not study_file.exists() or not study_file.stat().st_size):
            raise UserError(
                f"sweep.warm_start: {folder} has no Optuna study (no trial started, or its "
                f"{STUDY_FILE} is empty); let it run first"
            )
        record = parse_space(theirs).record()
        return _Source(str(folder), study_url(theirs, folder), folder.name, record, meta.get("trial_tokens"))
    url = cfg.sweep.storage_url
    if url:
        import optuna

        summaries = {s.study_name: s for s in optuna.get_all_study_summaries(rdb_storage(url))}
        if value in summaries:
            label = f"study {value!r} in {shown_url(url)}"
            attrs = summaries[value].user_attrs
            if SPACE_ATTR not in attrs:
                raise UserError(
                    f"sweep.warm_start: {label} records no search space (it was made by an older "
                    "gptrun); warm-start from its experiment folder instead"
                )
            return _Source(label, url, value, attrs[SPACE_ATTR], attrs.get(TOKENS_ATTR))
    where = f", nor a study in {shown_url(url)}" if url else ""
    raise UserError(
        f"sweep.warm_start={value!r} is not a sweep folder ({value}, {storage_dir / value}){where}; "
        "name an earlier sweep's folder, e.g. sweeps/NAME"
    )


def _copy(trial: Any, source: str) -> Any:
    """A finished trial as a new one for another study: its values, curve and params, tagged
    with where it came from (a trial copied from a warm-started sweep keeps its first origin)."""
    import optuna

    attrs = {k: v for k, v in trial.user_attrs.items() if k != TUNE_ID}
    attrs.setdefault(WARM_FROM, source)
    attrs.setdefault(WARM_TRIAL, trial.user_attrs.get(TUNE_ID, str(trial.number)))
    return optuna.trial.create_trial(
        state=trial.state,
        value=trial.value,
        params=trial.params,
        distributions=trial.distributions,
        user_attrs=attrs,
        intermediate_values=trial.intermediate_values,
    )


def describe(trials: list[Any], source: str) -> str:
    """'N trials of SOURCE (C completed, P stopped early; best val loss X)'."""
    import optuna

    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in trials)
    best = min(t.value for t in trials if t.value is not None)
    return (
        f"{len(trials)} trials of {source} ({len(trials) - pruned} completed, {pruned} stopped early; "
        f"best val loss {best:.4f})"
    )


def _note(cfg: RayExperiment, source: _Source, finished: list[Any]) -> str:
    startup = startup_trials(cfg.sweep.num_samples)
    start = (
        "TPE draws from its model from the first trial"
        if len(finished) >= startup
        else f"{startup - len(finished)} random start-up trial(s) first"
    )
    tokens = trial_tokens(cfg)
    budget = (
        f"; its trials trained {source.trial_tokens:,} tokens each, these train {tokens:,}"
        if source.trial_tokens and source.trial_tokens != tokens
        else ""
    )
    return f"warm start: {describe(finished, source.label)}: {start}{budget}"


def _entry(record: dict[str, Any], key: str) -> tuple[str, Any]:
    if key in record["params"]:
        return "searched", record["params"][key]
    if key in record["fixed"]:
        return "fixed", record["fixed"][key]
    return "absent", None


def _describe(record: dict[str, Any], key: str) -> str:
    how, value = _entry(record, key)
    if how == "absent":
        return "not in the space"
    if how == "fixed":
        return f"fixed to {value!r}"
    if value["kind"] == "choice":
        return f"choice {value['choices']}"
    zero = " or 0" if value["include_zero"] else ""
    return f"{value['kind']} [{value['low']:g}, {value['high']:g}]{zero}"
