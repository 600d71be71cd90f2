"""Reading a sweep back: one record per trial and every report, from Tune's experiment folder.

Works on finished, running and interrupted sweeps alike (it reads files, it starts no Ray).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from experiments.space import ZERO_SUFFIX
from experiments.table import print_columns
from gptcore.errors import UserError

STATUS_ORDER = ("completed", "stopped early", "diverged", "error", "unfinished")


def load_analysis(exp_dir: Path) -> Any:
    from ray.tune import ExperimentAnalysis

    if not (exp_dir / "gptrun.toml").exists() or not list(exp_dir.glob("experiment_state-*.json")):
        raise UserError(f"{exp_dir} is not a gptrun sweep folder (no gptrun.toml / Tune state); "
                        "pass the folder that `gptrun sweep` printed")
    return ExperimentAnalysis(str(exp_dir.resolve()))  # Ray reads a relative path as a URI


def trial_status(tune_status: str, last: dict[str, Any], max_tokens: float) -> str:
    if last.get("error"):
        return "error"
    if last.get("diverged"):
        return "diverged"
    if tune_status == "ERROR":
        return "error"
    if tune_status != "TERMINATED":
        return "unfinished"
    return "completed" if last.get("tokens", 0) >= max_tokens else "stopped early"


def load_trials(exp_dir: Path) -> list[dict[str, Any]]:
    """One dict per trial, best first: id, sampled config, status, losses, tokens, checkpoint."""
    exp_dir = Path(exp_dir)
    analysis = load_analysis(exp_dir)
    max_tokens = json.loads((exp_dir / "sweep.json").read_text())["trial_tokens"]
    trials = []
    for trial in analysis.trials:
        last = trial.last_result or {}
        status = trial_status(trial.status, last, max_tokens)
        val = last.get("val_loss", math.nan)
        trials.append({
            "trial_id": trial.trial_id, "config": dict(trial.config), "status": status,
            "val_loss": val if status not in ("diverged", "error") else math.nan,
            "best_val_loss": last.get("best_val_loss", math.nan),
            "val_bpb": last.get("val_bpb", math.nan), "tokens": last.get("tokens", 0.0),
            "step": last.get("step", 0.0), "wall_s": last.get("time_total_s", 0.0),
            "checkpoint": last.get("checkpoint_path", ""), "reason": last.get("reason", ""),
            "path": trial.path,
        })
    trials.sort(key=lambda t: (math.isnan(t["val_loss"]), t["val_loss"]))
    return trials


def load_curves(exp_dir: Path) -> list[dict[str, Any]]:
    """Every report of every trial: trial, tokens, step, train loss, val loss, lr, tokens/s."""
    analysis = load_analysis(Path(exp_dir))
    rows = []
    for trial_id, frame in analysis.trial_dataframes.items():
        for rec in frame.to_dict("records"):
            if "step" not in rec or rec.get("error") or rec.get("diverged"):
                continue
            rows.append({"trial_id": trial_id, "tokens": rec.get("tokens"), "step": rec["step"],
                         "loss": rec.get("loss"), "val_loss": rec.get("val_loss"),
                         "lr": rec.get("lr"), "tokens_per_sec": rec.get("tokens_per_sec")})
    return rows


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


def print_table(trials: list[dict[str, Any]]) -> None:
    """The terminal table: rank, hyperparameters, tokens, losses, status, wall time."""
    if not trials:
        print("no trials yet")
        return
    keys = sorted({k for t in trials for k in short_params(t["config"])})
    header = ["#", *keys, "tokens", "val_loss", "best", "bpb", "status", "wall"]
    rows = []
    for rank, t in enumerate(trials, 1):
        params = short_params(t["config"])
        rows.append([str(rank), *(fmt_value(params.get(k, "")) for k in keys),
                     f"{t['tokens']:,.0f}", fmt_value(t["val_loss"]), fmt_value(t["best_val_loss"]),
                     fmt_value(t["val_bpb"]), t["status"], f"{t['wall_s']:.0f}s"])
    print_columns(header, rows)
    for t in trials:
        if t["reason"]:
            print(f"  {t['trial_id']} {t['status']}: {t['reason']}")


def fmt_value(value: Any) -> str:
    """A table cell: 4 significant digits, '-' for NaN."""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)
