"""The private Optuna names that gptrun relies on, each behind one function (the fence: see
`gptcore.fence`; `gptrun doctor` checks every entry of `FENCED`). Checked against the source of
Optuna 5.1.0 (the version pyproject.toml pins); after an upgrade, check each against the new
source and run the test named. The private names of Ray's `OptunaSearch` are Ray's:
`experiments.private_ray`."""

from __future__ import annotations

from typing import Any

from gptcore.fence import Private

TRIAL_ID = Private(
    "optuna.trial._frozen", "FrozenTrial.self._trial_id", "optuna 5.1.0", "tests/test_sweep.py"
)
FENCED = [TRIAL_ID]


def storage_trial_id(trial: Any) -> int:
    """The storage's id of an Optuna `FrozenTrial` (not its number), which `optuna.Trial(study,
    id)` takes to act on a trial asked by an earlier process: `_trial_id`."""
    return trial._trial_id
