"""The report's data: one flat row per trial (its final loss and its loss at the common
budget), the best trial, and the files a notebook reads (trials.parquet/.csv, curves.parquet),
each written whole or not at all."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.noise import NOISE_FILE
from experiments.report.common import CommonTokens
from experiments.results import short_params
from gptcore.atomic import atomic_file
from gptcore.errors import UserError

COLUMNS = (
    "tokens",
    "val_loss",
    "common_tokens",
    "common_val_loss",
    "best_val_loss",
    "val_bpb",
    "status",
    "wall_s",
    "startup_s",
    "winddown_s",
    "node_id",
    "checkpoint",
    "reason",
)
PARAMS = ("lr", "weight_decay", "warmup")  # always present, first; other searched keys follow
CURVE_COLUMNS = ("trial_id", "tokens", "step", "loss", "val_loss", "lr", "tokens_per_sec")


def trial_rows(trials: list[dict[str, Any]], common: CommonTokens) -> list[dict[str, Any]]:
    """One flat row per trial (best final loss first): rank, id, hyperparameters, tokens, final
    loss, the common token count and the loss there (NaN for a trial not compared), best loss, bpb,
    status, times, node, checkpoint, reason. An empty list when there are no trials."""
    names = {k for t in trials for k in short_params(t["config"])}
    params = [*PARAMS, *sorted(names - set(PARAMS))]
    rows = []
    for rank, t in enumerate(trials, 1):
        p = short_params(t["config"])
        at = {"common_tokens": common.tokens, "common_val_loss": common.losses.get(t["trial_id"], math.nan)}
        rows.append(
            {
                "rank": rank,
                "trial_id": t["trial_id"],
                **{k: p.get(k) for k in params},
                **{k: at[k] if k in at else t[k] for k in COLUMNS},
            }
        )
    return rows


def write_tables(rows: list[dict[str, Any]], curves: list[dict[str, Any]], out_dir: Path) -> None:
    """trials.parquet + trials.csv (full node ids, NaN for unknown times) and curves.parquet."""
    names = rows[0] if rows else ("rank", "trial_id", *PARAMS, *COLUMNS)
    _write_table({k: [r[k] for r in rows] for k in names}, out_dir / "trials", csv=True)
    _write_table({k: [c[k] for c in curves] for k in CURVE_COLUMNS}, out_dir / "curves", csv=False)


def _write_table(columns: dict[str, list[Any]], stem: Path, *, csv: bool) -> None:
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet as pq

    table = pa.table({k: pa.array(v) for k, v in columns.items()})
    write(stem.with_suffix(".parquet"), lambda tmp: pq.write_table(table, tmp))
    if csv:
        write(stem.with_suffix(".csv"), lambda tmp: pyarrow.csv.write_csv(table, tmp))


def write(path: Path, writer: Callable[[Path], Any]) -> None:
    """Write `path` whole or not at all, readable by others (it is a report to share)."""
    with atomic_file(path) as tmp:
        writer(tmp)
        tmp.chmod(0o644)


def read_noise(exp_dir: Path) -> dict[str, Any] | None:
    """noise.json as `gptrun confirm` wrote it; None when there is none, or when an older gptrun
    wrote it with another noise fraction (its re-runs are kept, so confirm recomputes it fast);
    one line when it is damaged (not a JSON object), which confirm recomputes the same way."""
    path = exp_dir / NOISE_FILE
    if not path.exists():
        return None
    redo = "run `gptrun confirm` again with the same --top and --seeds to recompute it from its finished runs"
    try:
        noise = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        noise = err
    if not isinstance(noise, dict):
        raise UserError(f"{path} is damaged (not a JSON object: {noise}); {redo}")
    if "sweep_std" in noise:
        return noise
    print(f"note: {path} is from an older gptrun; {redo}")
    return None
