"""What happened to each trial, told once: one console line per trial event in the sweep driver,
and the same events in `EXPERIMENT/events.jsonl` for the results reader.

These are announcements, derived from what Tune and the study saw; the record of each trial's
life is the study (`experiments.record`). Each trial's end and ASHA stop is announced once: the
announcements already in `events.jsonl` are read when a (resumed) sweep starts, so an end that a
resume replays is not announced again, and one that a killed driver never announced is.

ASHA's stops are announced by `RecordingASHA` when it decides them. Start and end times, with
the `fit_start_unix` / `report_unix` each trial reports, give every trial's fixed cost: from its
process being ready to its first step, and from its last report to its end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ray.tune import Callback
from ray.tune.schedulers import ASHAScheduler, TrialScheduler
from ray.tune.stopper import Stopper

from experiments import remote
from experiments.experiment import EVENTS_FILE, append_event, read_events
from experiments.outcome import FLAGS
from experiments.ray_config import SweepLimit


def _params(config: dict[str, Any]) -> str:
    from experiments.results import fmt_value, short_params

    return ", ".join(f"{k}={fmt_value(v)}" for k, v in short_params(config).items())


class RecordingASHA(ASHAScheduler):
    """ASHA on tokens that writes down each trial it stops, and says so on the console."""

    def __init__(self, exp_dir: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exp_dir, self.full_tokens = exp_dir, kwargs["max_t"]

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        decision = super().on_trial_result(tune_controller, trial, result)
        tokens = result.get("tokens", 0)
        stopped = decision == TrialScheduler.STOP and tokens < self.full_tokens  # not just finished
        if (
            stopped
            and not result.get("replayed")
            and not announced(self.exp_dir, trial.trial_id, "asha_stop")
        ):
            append_event(
                self.exp_dir,
                {"event": "asha_stop", "trial_id": trial.trial_id, "tokens": tokens, "unix": time.time()},
            )
            print(
                f"trial {trial.trial_id} stopped early by ASHA at {tokens:,.0f} tokens "
                f"(val loss {result.get('val_loss', float('nan')):.4f})",
                flush=True,
            )
        return decision


def announced(exp_dir: Path, trial_id: str, event: str) -> bool:
    """Whether `events.jsonl` already tells `event` of `trial_id`."""
    return any(e["event"] == event and e["trial_id"] == trial_id for e in read_events(exp_dir))


class SweepBudget(Stopper):
    """`sweep.budget` as it is spent: the wall-clock of the sweep, or the tokens its trials
    trained (each trial's latest report, summed over all trials). Tune ends every trial once
    `stop_all` turns true, as it does for its own `time_budget_s`, and tells no callback: the
    first time, this says so on the console and as a `budget_spent` event, from which
    `TrialEvents` tells those ends.

    Tune keeps its stopper in its experiment state with the trials, so a resumed sweep counts
    from the sweep's start: the tokens reported before the last snapshot are here (those
    reported after it are reported again by the trials that continue), and so is the time spent;
    the time between a kill and its resume is not counted (`__setstate__`), as in Tune's own."""

    def __init__(self, exp_dir: Path, limit: SweepLimit) -> None:
        self.exp_dir, self.limit = exp_dir, limit
        self.tokens: dict[str, float] = {}  # trial id -> tokens at its latest report
        self.spent_s = 0.0
        self.last_check: float | None = None  # the clock runs from the first `stop_all`

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, last_check=None)

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        """Each result as it comes, so that the one that spends the budget ends the sweep at once."""
        self.tokens[trial_id] = result.get("tokens", 0)
        return False

    def stop_all(self) -> bool:
        now = time.time()
        self.spent_s += now - (self.last_check or now)
        self.last_check = now
        spent = sum(self.tokens.values()) if self.limit.tokens else self.spent_s
        if spent < self.limit.amount:
            return False
        if not budget_spent(self.exp_dir):
            append_event(self.exp_dir, {"event": "budget_spent", "spent": spent, "unix": now})
            print(f"the sweep's budget of {self.limit} is spent: the trials running end here", flush=True)
        return True


def budget_spent(exp_dir: Path) -> bool:
    """Whether `events.jsonl` says the sweep's budget is spent (`SweepBudget`)."""
    return any(e["event"] == "budget_spent" for e in read_events(exp_dir))


class TrialEvents(Callback):
    """Start, end and error of every trial: one line each, and a line in events.jsonl.

    Tune ends the trials that are running when `sweep.budget` runs out (`SweepBudget`) without
    calling `on_trial_complete`: `on_experiment_end` tells their end instead, once the budget is
    spent (an interrupted sweep's trials are not ended: `gptrun resume` continues them)."""

    def __init__(self, exp_dir: Path, full_tokens: int) -> None:
        self.exp_dir, self.full_tokens = exp_dir, full_tokens
        self.ended: set[str] = set()

    def setup(self, **info: Any) -> None:
        self.ended = {e["trial_id"] for e in read_events(self.exp_dir) if e["event"] in ("end", "error")}

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if trial.trial_id in self.ended:  # a resume replaying its end starts it for a moment
            return
        append_event(self.exp_dir, {"event": "start", "trial_id": trial.trial_id, "unix": time.time()})
        print(f"trial {trial.trial_id} started: {_params(trial.config)}", flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if trial.trial_id in self.ended:
            return
        self.ended.add(trial.trial_id)
        last = trial.last_result or {}
        append_event(self.exp_dir, {"event": "end", "trial_id": trial.trial_id, "unix": time.time()})
        print(f"trial {trial.trial_id} {self.describe(trial.trial_id, last)}", flush=True)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self._cut_by_budget(trials)
        remote.upload_soon(self.exp_dir, EVENTS_FILE, now=True)  # the last batch

    def _cut_by_budget(self, trials: list) -> None:
        """End the trials the spent budget cut (Tune ends them without telling anyone)."""
        if not budget_spent(self.exp_dir):
            return
        for trial in trials:
            if trial.trial_id not in self.ended and trial.last_result and trial.status != "ERROR":
                self.on_trial_complete(0, trials, trial)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if trial.trial_id in self.ended:
            return
        self.ended.add(trial.trial_id)
        append_event(self.exp_dir, {"event": "error", "trial_id": trial.trial_id, "unix": time.time()})
        print(f"trial {trial.trial_id} failed: {trial.error_file or 'see its error.txt'}", flush=True)

    def describe(self, trial_id: str, last: dict[str, Any]) -> str:
        tokens, loss = last.get("tokens", 0), last.get("val_loss", float("nan"))
        for flag in FLAGS:
            if last.get(flag):
                return f"{'failed' if flag == 'error' else flag}: {last.get('reason', '')}"
        if tokens >= self.full_tokens:
            return f"completed: {tokens:,.0f} tokens, val loss {loss:.4f}"
        if announced(self.exp_dir, trial_id, "asha_stop"):
            return f"ended after ASHA's stop at {tokens:,.0f} tokens, val loss {loss:.4f}"
        return f"cut by the sweep budget at {tokens:,.0f} tokens, val loss {loss:.4f}"
