"""`gptrun report`: its tables and page on made-up trials (fast, no Ray), then the command on a
real finished sweep, an interrupted copy of it, and a folder that is not one."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from matplotlib.image import imread

from experiments.config import load_experiment
from experiments.report.data import best_trial, trial_rows
from experiments.report.page import html_page
from experiments.results import print_table
from experiments.table import print_columns
from tests.conftest import assert_user_error, run_cli, study_values

PNGS = ("curves.png", "lr.png", "warmup.png", "parallel.png")
FILES = ("trials.parquet", "trials.csv", "curves.parquet", "report.html", "best.toml", *PNGS)
COLUMNS = [
    "rank",
    "trial_id",
    "lr",
    "weight_decay",
    "warmup",
    "tokens",
    "val_loss",
    "best_val_loss",
    "val_bpb",
    "status",
    "wall_s",
    "startup_s",
    "winddown_s",
    "node_id",
    "checkpoint",
    "reason",
]
NODE = "c108cccc9fc72185316a274a500aa6064a760baea79e11bcc26a8289"


def _trial(tid: str, status: str, loss: float, **extra: Any) -> dict[str, Any]:
    return {
        "trial_id": tid,
        "status": status,
        "val_loss": loss,
        "best_val_loss": loss,
        "val_bpb": loss / 2,
        "tokens": 3072.0,
        "wall_s": 3.9,
        "startup_s": 2.5,
        "winddown_s": math.nan,
        "node_id": NODE,
        "checkpoint": "",
        "reason": "",
        "config": {"optim.lr": 3e-3, "optim.weight_decay": 0.1, "optim.warmup": 0.1},
        **extra,
    }


def test_print_columns_right_aligns_each_column(capsys: pytest.CaptureFixture[str]) -> None:
    print_columns(["#", "name", "loss"], [["1", "a", "5.1"], ["10", "bbbbbb", "-"]])
    print_columns(["#", "name"], [])
    assert capsys.readouterr().out.splitlines() == [
        " #    name  loss",
        " 1       a   5.1",
        "10  bbbbbb     -",
        "#  name",
    ]


def test_terminal_table(capsys: pytest.CaptureFixture[str]) -> None:
    print_table(
        [
            _trial("t1", "completed", 3.75726),
            _trial("t2", "cut by budget", 4.0, node_id="", tokens=12345.0, reason="time budget"),
        ]
    )
    assert capsys.readouterr().out.splitlines() == [
        "#     lr  warmup  weight_decay  tokens  val_loss   best    bpb         status  wall      node",
        "1  0.003     0.1           0.1   3,072     3.757  3.757  1.879      completed    4s  c108cccc",
        "2  0.003     0.1           0.1  12,345         4      4      2  cut by budget    4s         -",
        "  t2 cut by budget: time budget",
    ]


def test_rows_best_and_page_from_made_up_trials(tmp_path: Path) -> None:
    trials = [
        _trial("run", "unfinished", 3.0),
        _trial("ok", "cut by budget", 3.5),
        _trial("bad", "diverged", math.nan),
    ]
    rows = trial_rows(trials)
    assert list(rows[0]) == COLUMNS
    assert rows[1]["node_id"] == NODE and rows[1]["startup_s"] == 2.5  # full id in the files
    assert best_trial(trials)["trial_id"] == "ok"  # unfinished and diverged trials never win
    assert best_trial(trials[:1]) is None

    page = html_page(tmp_path / "sweep", trials, rows, best_trial(trials), (True, "1 left out"), "")
    assert "<td>c108cccc</td>" in page and NODE not in page  # 8 characters in the page
    assert "<td>2.5</td><td>-</td>" in page  # start-up, then an unknown wind-down
    assert "<tr class='cut-by-budget'>" in page and "Best trial <b>ok</b>" in page
    assert "<img src='importance.png' alt='hyperparameter importance'><p>1 left out</p>" in page
    page = html_page(tmp_path / "sweep", trials, rows, None, (False, "No optuna.db"), "")
    assert "src='importance.png'" not in page and "<p>No optuna.db</p>" in page


def test_importance_budget_leaves_out_trials_without_a_report_by_then() -> None:
    """The common budget is the largest token count every reporting trial reached; a finished
    trial with no report at or before it (one that failed before its first evaluation, or whose
    only value is a failure's score at the full budget, as earlier gptrun wrote it) is left out
    and counted, not a `max()` of nothing that drops the importances of the whole sweep."""
    import optuna

    from experiments.report.plots import _at_common_budget

    lr = optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)
    state = optuna.trial.TrialState

    def trial(lr_value: float, steps: dict[int, float], value: float | None, st: Any = state.COMPLETE) -> Any:
        return optuna.trial.create_trial(
            params={"optim.lr": lr_value},
            distributions={"optim.lr": lr},
            value=value,
            intermediate_values=steps,
            state=st,
        )

    trials = [
        trial(1e-3, {512: 5.0, 1024: 4.6}, 4.6, state.PRUNED),  # ASHA stopped it at 1024 tokens
        trial(2e-3, {512: 5.2, 1024: 4.4, 3072: 3.7}, 3.7),  # completed
        trial(3e-3, {}, 11.9),  # failed before its first evaluation: a bad score, no report
        trial(4e-3, {3072: 11.9}, 11.9),  # the same, as an earlier gptrun recorded it
        trial(5e-3, {512: 5.9}, None, state.FAIL),  # a Tune error: never counted
    ]
    common, study, left_out = _at_common_budget(trials)
    assert (common, left_out) == (1024, 2)
    assert [(t.params["optim.lr"], t.value) for t in study.trials] == [(1e-3, 4.6), (2e-3, 4.4)]


def _trial_dirs(exp_dir: Path) -> list[Path]:
    return [p for p in exp_dir.iterdir() if p.is_dir() and p.name.startswith("trial_")]


def test_report_writes_every_file(finished_sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = run_cli("report", str(finished_sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "val_loss" in proc.stdout and "best trial" in proc.stdout
    assert f"study: optuna-dashboard sqlite:///{(finished_sweep / 'optuna.db').resolve()}\n" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].endswith(str(out / "report.html"))
    for name in (*FILES, "importance.png"):  # the fixture finished, so optuna.db exists
        assert (out / name).is_file(), name
    for name in (*PNGS, "importance.png"):
        image = imread(out / name)
        assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 400, (name, image.shape)

    table = pq.read_table(out / "trials.parquet")
    assert table.column_names == COLUMNS
    assert table.num_rows == len(_trial_dirs(finished_sweep)) == 6
    rows = table.to_pylist()
    assert [r["rank"] for r in rows] == list(range(1, 7))
    assert all(len(r["node_id"]) > 8 for r in rows)  # the full Ray node id
    assert all(
        math.isfinite(r["startup_s"]) and r["startup_s"] >= 0 for r in rows if r["status"] == "completed"
    )
    assert (out / "trials.csv").read_text().count("\n") == 7
    assert pq.read_table(out / "curves.parquet").num_rows >= 6

    best = next(r for r in rows if r["status"] in ("completed", "stopped early", "cut by budget"))
    cfg = load_experiment(out / "best.toml")
    assert cfg.optim.lr == best["lr"] and cfg.optim.weight_decay == best["weight_decay"]
    assert cfg.optim.warmup == best["warmup"]
    assert cfg.train.out == "runs/finished-best"
    assert cfg.train.max_steps == load_experiment(finished_sweep / "gptrun.toml").train.max_steps

    page = (out / "report.html").read_text()
    for name in (*PNGS, "importance.png"):
        assert f"src='{name}'" in page
    assert best["trial_id"] in page and "checkpoint" in page
    assert f"<td>{rows[0]['node_id'][:8]}</td>" in page and rows[0]["node_id"] not in page
    assert "ran with the baseline config" in page and "<table>" in page


def test_study_holds_every_report_of_every_trial(finished_sweep: Path, tmp_path: Path) -> None:
    """Each study trial's intermediate values are its curve in curves.parquet, the last report
    included (Tune hands the result that ends a trial to `on_trial_complete` only); a PRUNED
    trial's value is the loss at which ASHA stopped it, a COMPLETE one's its final loss."""
    proc = run_cli("report", str(finished_sweep), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    curves: dict[str, dict[int, float]] = {}
    for row in pq.read_table(tmp_path / "curves.parquet").to_pylist():
        curves.setdefault(row["trial_id"], {})[int(row["tokens"])] = row["val_loss"]
    statuses = {r["trial_id"]: r["status"] for r in pq.read_table(tmp_path / "trials.parquet").to_pylist()}
    study = study_values(f"sqlite:///{finished_sweep / 'optuna.db'}", finished_sweep.name)
    assert sorted(study) == sorted(curves) == sorted(statuses)
    for tid, (state, value, steps) in study.items():
        assert steps == pytest.approx(curves[tid], rel=1e-12), tid
        last = curves[tid][max(curves[tid])]
        expected = {"stopped early": "PRUNED", "completed": "COMPLETE"}[statuses[tid]]
        assert (state, value) == (expected, pytest.approx(last, rel=1e-12)), (tid, statuses[tid])
    assert {state for state, _, _ in study.values()} == {"PRUNED", "COMPLETE"}


def test_report_interrupted_sweep(finished_sweep: Path, tmp_path: Path) -> None:
    copy = tmp_path / "finished"
    shutil.copytree(finished_sweep, copy, ignore=shutil.ignore_patterns("report", "best.toml"))
    (copy / "optuna.db").unlink(missing_ok=True)  # written only when a sweep finishes
    state_file = sorted(copy.glob("experiment_state-*.json"))[-1]
    state = json.loads(state_file.read_text())
    trial = json.loads(state["trial_data"][-1][0])
    trial["status"] = "RUNNING"
    state["trial_data"][-1][0] = json.dumps(trial)
    state_file.write_text(json.dumps(state))

    proc = run_cli("report", str(copy))  # default --out: EXPERIMENT_DIR/report
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = copy / "report"
    for name in FILES:
        assert (out / name).is_file(), name
    assert not (out / "importance.png").exists()
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    assert len(rows) == 6
    assert {r["trial_id"]: r["status"] for r in rows}[trial["trial_id"]] == "unfinished"
    assert "unfinished" in proc.stdout
    page = (out / "report.html").read_text()
    assert "<tr class='unfinished'>" in page and "No optuna.db" in page


def test_report_needs_matplotlib(finished_sweep: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib blocked by the test')\n")
    pythonpath = f"{blocker.parent}:{Path(__file__).resolve().parents[1]}"
    proc = run_cli(
        "report", str(finished_sweep), "--out", str(tmp_path / "r"), env={"PYTHONPATH": pythonpath}
    )
    assert_user_error(proc, "matplotlib", "pip install 'gptrun[report]'")
    assert not (tmp_path / "r").exists()


def test_report_not_an_experiment(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a sweep")
    assert_user_error(run_cli("report", str(tmp_path)), str(tmp_path), "not a gptrun sweep folder")
