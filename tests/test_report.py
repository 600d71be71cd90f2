"""`gptrun report` on a real finished sweep, an interrupted copy of it, and a folder that is not one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from matplotlib.image import imread

from gptcore.config import load_config
from tests.conftest import assert_user_error, run_cli

PNGS = ("curves.png", "lr.png", "warmup.png", "parallel.png")
FILES = ("trials.parquet", "trials.csv", "curves.parquet", "report.html", "best.toml", *PNGS)
COLUMNS = ["rank", "trial_id", "lr", "weight_decay", "warmup", "tokens", "val_loss",
           "best_val_loss", "val_bpb", "status", "wall_s", "checkpoint", "reason"]


def _trial_dirs(exp_dir: Path) -> list[Path]:
    return [p for p in exp_dir.iterdir() if p.is_dir() and p.name.startswith("run_trial_")]


def test_report_writes_every_file(finished_sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = run_cli("report", str(finished_sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "val_loss" in proc.stdout and "best trial" in proc.stdout
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
    assert (out / "trials.csv").read_text().count("\n") == 7
    assert pq.read_table(out / "curves.parquet").num_rows >= 6

    best = next(r for r in rows if r["status"] in ("completed", "stopped early"))
    cfg = load_config(out / "best.toml")
    assert cfg.optim.lr == best["lr"] and cfg.optim.weight_decay == best["weight_decay"]
    assert cfg.optim.warmup == best["warmup"]
    assert cfg.train.out == "runs/finished-best"
    assert cfg.train.max_steps == load_config(finished_sweep / "gptrun.toml").train.max_steps

    page = (out / "report.html").read_text()
    for name in (*PNGS, "importance.png"):
        assert f"src='{name}'" in page
    assert best["trial_id"] in page and "checkpoint" in page
    assert "ran with the baseline config" in page and "<table>" in page


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
    proc = run_cli("report", str(finished_sweep), "--out", str(tmp_path / "r"),
                   env={"PYTHONPATH": pythonpath})
    assert_user_error(proc, "matplotlib", "pip install 'gptrun[report]'")
    assert not (tmp_path / "r").exists()


def test_report_not_an_experiment(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a sweep")
    assert_user_error(run_cli("report", str(tmp_path)), str(tmp_path), "not a gptrun sweep folder")
