"""Reading a sweep back: one record per trial and every report, from Tune's experiment folder.

Works on finished, running and interrupted sweeps alike (it reads files, it starts no Ray).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from experiments import remote
from experiments.experiment import is_experiment, load_base, read_events, study_url
from experiments.outcome import FLAGS, RANKED, ended_status
from experiments.ray_config import RayExperiment
from experiments.record import read_records
from experiments.space import ZERO_SUFFIX, Space, apply_overrides
from experiments.table import fmt_sci, fmt_tokens, print_columns, short_ids
from experiments.tune_state import TuneTrial, read_tune_trials
from gptcore.errors import UserError

if TYPE_CHECKING:
    from experiments.report.common import CommonTokens


def load_tune_trials(exp_dir: Path) -> list[TuneTrial]:
    """Tune's view of the experiment's trials, read as JSON from where Tune keeps it (its
    folder, or its URI for an experiment in object storage): nothing is unpickled
    (`experiments.tune_state`)."""
    where = remote.location(exp_dir)  # absolute: Ray reads a relative path as a URI
    if not is_experiment(exp_dir) or not remote.has_tune_state(where):
        raise UserError(
            f"{where} is not a gptrun sweep folder (no gptrun.toml / Tune state); "
            "pass the folder that `gptrun sweep` printed"
        )
    return read_tune_trials(where)  # UserError for a damaged state, naming its file


def tune_status(tune_status: str, last: dict[str, Any], max_tokens: float, asha_stopped: bool) -> str:
    """A trial's status from Tune's view alone, where the study has no record of it (a confirm
    run, a trial the budget cut before the sweep closed it, a study out of reach): `unfinished`
    while Tune has not ended it, else the outcome rule on its last report."""
    if tune_status not in ("TERMINATED", "ERROR"):
        return "unfinished"
    if tune_status == "ERROR":
        return "error"
    return ended_status(last, max_tokens, cut=not asha_stopped)


def load_trials(exp_dir: Path) -> list[dict[str, Any]]:
    """One dict per trial, best first: id, sampled config, status, losses, tokens, checkpoint,
    node, and its fixed cost (seconds from its process being ready to its first step, and from
    its last report to its end). A trial's status and final report come from its record in the
    study (`experiments.record`) where there is one, else from Tune's view."""
    exp_dir = Path(exp_dir)
    tune_trials = load_tune_trials(exp_dir)
    cfg, meta = load_base(exp_dir)
    max_tokens = meta["trial_tokens"]
    records = read_records(study_url(cfg, exp_dir), exp_dir.name)
    events = read_events(exp_dir)
    asha = {e["trial_id"] for e in events if e["event"] == "asha_stop"}
    trials = []
    for trial in tune_trials:
        record = records.pop(trial.trial_id, None)
        if record is not None and record.ended:
            status = record.status or STATE_STATUS[record.state]
            last = {**(trial.last_result or {}), **record.final}
        else:
            last = trial.last_result or {}
            status = tune_status(trial.status, last, max_tokens, trial.trial_id in asha)
        checkpoint = last.get("checkpoint_path") or trial.newest_checkpoint()
        trials.append(_row(trial.trial_id, trial.config, status, last, checkpoint, trial.path, events))
    for tune_id, record in records.items():  # ended before Tune's last snapshot knew them
        if record.ended:
            status = record.status or STATE_STATUS[record.state]
            trials.append(_row(tune_id, record.config, status, record.final, "", "", events))
    trials.sort(key=lambda t: (math.isnan(t["val_loss"]), t["val_loss"]))
    return trials


STATE_STATUS = {"COMPLETE": "completed", "PRUNED": "stopped early", "FAIL": "error"}  # no status attr


def _row(
    trial_id: str,
    config: dict[str, Any],
    status: str,
    last: dict[str, Any],
    checkpoint: str,
    path: str,
    events: list[dict[str, Any]],
) -> dict[str, Any]:
    val = last.get("val_loss", math.nan)
    return {
        "trial_id": trial_id,
        "config": config,
        "status": status,
        "val_loss": val if status in RANKED else math.nan,
        "best_val_loss": last.get("best_val_loss", math.nan),
        "val_bpb": last.get("val_bpb", math.nan),
        "tokens": last.get("tokens", 0.0),
        "step": last.get("step", 0.0),
        "wall_s": last.get("time_total_s", 0.0),
        "checkpoint": checkpoint,
        "reason": last.get("reason", ""),
        "node_id": last.get("node_id", ""),
        "path": path,
        **_fixed_cost(trial_id, events, last),
    }


def _fixed_cost(trial_id: str, events: list[dict[str, Any]], last: dict[str, Any]) -> dict[str, float]:
    """Start-up: the trial's last start event to its `fit_start_unix` (the loop's first step);
    wind-down: its last report to its end event. NaN where an event is missing."""
    mine = [e for e in events if e.get("trial_id") == trial_id]  # not the sweep's `budget_spent`
    starts = [e["unix"] for e in mine if e["event"] == "start"]
    ends = [e["unix"] for e in mine if e["event"] == "end"]
    fit_start, reported = last.get("fit_start_unix"), last.get("report_unix")
    startup = fit_start - starts[-1] if starts and fit_start and fit_start >= starts[-1] else math.nan
    winddown = ends[-1] - reported if ends and reported and ends[-1] >= reported else math.nan
    return {"startup_s": startup, "winddown_s": winddown}


def best_config(cfg: RayExperiment, space: Space, trial: dict[str, Any], name: str) -> RayExperiment:
    """The base config with a trial's values: a complete config that trains it at full length
    (into `runs/NAME-best`). What `best.toml` holds, for the sweep and the report alike."""
    best = apply_overrides(cfg, space.overrides(trial["config"]))
    return apply_overrides(best, {"train.out": f"runs/{name}-best"})


def load_curves(exp_dir: Path) -> list[dict[str, Any]]:
    """Every report of every trial, once per (trial, step): trial, tokens, step, train loss, val
    loss, lr, tokens/s. A resume replays the steps after a trial's checkpoint (the later report
    of a step is kept) and replays an ended trial's last report (left out)."""
    rows: dict[tuple[str, float], dict[str, Any]] = {}
    for trial in load_tune_trials(Path(exp_dir)):
        trial_id = trial.trial_id
        for rec in trial.reports():
            if "step" not in rec or any(_flag(rec.get(k)) for k in (*FLAGS, "replayed")):
                continue
            rows[trial_id, rec["step"]] = {
                "trial_id": trial_id,
                "tokens": rec.get("tokens"),
                "step": rec["step"],
                "loss": rec.get("loss"),
                "val_loss": rec.get("val_loss"),
                "lr": rec.get("lr"),
                "tokens_per_sec": rec.get("tokens_per_sec"),
            }
    return list(rows.values())


def _flag(value: Any) -> bool:
    """A flag column of a trial's results: 1.0 where set, NaN (pandas) or absent where not."""
    return isinstance(value, (int, float)) and not math.isnan(value) and bool(value)


def short_params(config: dict[str, Any]) -> dict[str, Any]:
    """`optim.lr` -> `lr`, and the include-zero flags folded into their values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key.endswith(ZERO_SUFFIX):
            if value:
                out[key.removesuffix(ZERO_SUFFIX).rpartition(".")[2]] = 0.0
            continue
        out.setdefault(key.rpartition(".")[2], value)
    return out


def print_table(
    trials: list[dict[str, Any]], space: Space | None = None, common: CommonTokens | None = None
) -> None:
    """The terminal table: rank, hyperparameters (log-scale ones of `space` in scientific
    notation), tokens, final loss, the loss at the common token count (with `common`), best loss, bpb,
    status, wall time, node; then the reason of each trial that has one (an error, a divergence)."""
    if not trials:
        print("no trials yet")
        return
    keys = sorted({k for t in trials for k in short_params(t["config"])})
    sci = {p.key.rpartition(".")[2] for p in space.params if p.kind == "loguniform"} if space else set()
    at = [f"at {fmt_tokens(common.tokens)}"] if common else []
    header = ["#", *keys, "tokens", "val_loss", *at, "best", "bpb", "status", "wall", "node"]
    nodes = short_ids(t["node_id"] for t in trials)
    rows = []
    for rank, t in enumerate(trials, 1):
        params = short_params(t["config"])
        rows.append(
            [
                str(rank),
                *(
                    fmt_sci(params[k]) if k in sci and k in params else fmt_value(params.get(k, ""))
                    for k in keys
                ),
                fmt_tokens(t["tokens"]),
                fmt_value(t["val_loss"]),
                *([fmt_value(common.losses.get(t["trial_id"], math.nan))] if common else []),
                fmt_value(t["best_val_loss"]),
                fmt_value(t["val_bpb"]),
                t["status"],
                f"{t['wall_s']:.0f}s",
                nodes.get(t["node_id"], "-"),
            ]
        )
    print_columns(header, rows)
    for t in trials:
        if t["reason"]:
            print(f"  {t['trial_id']} {t['status']}: {t['reason']}")


def print_trial_costs(trials: list[dict[str, Any]]) -> None:
    """Each trial's fixed cost: what it spent outside training besides evaluation."""
    measured = [t for t in trials if not math.isnan(t["startup_s"])]
    if not measured:
        return
    print("fixed cost per trial (trial start -> training loop | last report -> trial end):")
    for t in sorted(measured, key=lambda t: t["trial_id"]):
        print(f"  {t['trial_id']}: start-up {t['startup_s']:.2f}s | wind-down {t['winddown_s']:.2f}s")


def fmt_value(value: Any) -> str:
    """A table cell: 4 significant digits, '-' for NaN."""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)
