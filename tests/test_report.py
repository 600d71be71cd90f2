"""`gptrun report`: the common-budget rule, the importances and the page on made-up trials (fast,
no Ray), then the command on a real finished sweep, copies of it (interrupted, one trial, every
trial failed), and a folder that is not one."""

from __future__ import annotations

import base64
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from matplotlib.image import imread

from experiments.cli import main
from experiments.experiment import start_experiment
from experiments.outcome import best_trial
from experiments.ray_config import load_experiment
from experiments.report.common import CommonTokens, analysis_study, common_tokens
from experiments.report.importance import MIN_TRIALS, importances, too_few
from experiments.report.interactive import parallel_figure
from experiments.report.page import report_page
from experiments.report.tables import trial_rows
from experiments.results import print_table
from experiments.space import apply_overrides, parse_space
from experiments.table import fmt_sci, fmt_tokens, print_columns, short_ids
from tests.conftest import REPO, assert_user_error, run_cli, study_values

PNGS = ("curves.png", "params.png")
PLOTS = ("curves", "params", "contour", "parallel")  # the page's interactive plots (+ importance)
QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "quickstart.toml"
FILES = ("trials.parquet", "trials.csv", "curves.parquet", "report.html", "best.toml", *PNGS)
COLUMNS = [
    "rank",
    "trial_id",
    "lr",
    "weight_decay",
    "warmup",
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


def test_readable_numbers() -> None:
    assert [fmt_tokens(x) for x in (0, 512, 76_800, 102_400, 153_600, 999_950, 1_228_800, 2.5e9)] == [
        "0",
        "512",
        "76.8k",
        "102k",
        "154k",
        "1M",
        "1.23M",
        "2.5G",
    ]
    assert [fmt_sci(x) for x in (1.75e-3, 2e-3, 0.02614, 0.0, 3e-1)] == [
        "1.75e-3",
        "2e-3",
        "2.61e-2",
        "0",
        "3e-1",
    ]


def test_node_ids_are_shown_by_the_part_that_tells_them_apart() -> None:
    real = ["3f2a9c1e77d0b4a1", "9b01c4d2e5f60718"]
    fake = ["f" * 51 + "00001", "f" * 51 + "00002"]  # Ray's fake multi-node provider's ids
    assert short_ids([*real, *real, ""]) == {real[0]: "3f2a9c1e", real[1]: "9b01c4d2"}
    assert short_ids([*fake, real[0]]) == {fake[0]: "fff00001", fake[1]: "fff00002", real[0]: "3f2a9c1e"}


def test_terminal_table(capsys: pytest.CaptureFixture[str]) -> None:
    space = parse_space(load_experiment(QUICKSTART))
    common = CommonTokens(3072, {"t1": 3.9}, ())
    print_table(
        [
            _trial("t1", "completed", 3.75726),
            _trial("t2", "cut by budget", 4.0, node_id="", tokens=12345.0, reason="time budget"),
        ],
        space,
        common,
    )
    assert [line.split() for line in capsys.readouterr().out.splitlines()] == [
        "# lr warmup weight_decay tokens val_loss at 3.07k best bpb status wall node".split(),
        "1 3e-3 0.1 1e-1 3.07k 3.757 3.9 3.757 1.879 completed 4s c108cccc".split(),
        "2 3e-3 0.1 1e-1 12.3k 4 - 4 2 cut by budget 4s -".split(),
        "t2 cut by budget: time budget".split(),
    ]  # print_columns' alignment is tested above


K = 1024


def _curve(tid: str, losses: dict[int, float]) -> list[dict[str, Any]]:
    return [{"trial_id": tid, "tokens": float(k * K), "val_loss": v} for k, v in losses.items()]


def test_common_token_count_of_trials_stopped_at_different_rungs() -> None:
    """The default budget is the largest token count every trial that finished reached (here
    ASHA's first rung, 100k); each compared trial's loss is its last evaluation at or before
    it, not its final loss; diverged and failed trials are not compared; a running trial is once
    it passed the budget; a finished trial with no evaluation by then is left out and named."""
    trials = [
        {"trial_id": "full", "status": "completed"},
        {"trial_id": "rung1", "status": "stopped early"},
        {"trial_id": "rung2", "status": "stopped early"},
        {"trial_id": "offgrid", "status": "cut by budget"},
        {"trial_id": "nan", "status": "diverged"},
        {"trial_id": "err", "status": "error"},
        {"trial_id": "running", "status": "unfinished"},
        {"trial_id": "young", "status": "unfinished"},
        {"trial_id": "none", "status": "cut by budget"},
    ]
    curves = [
        *_curve("full", {50: 6.0, 100: 5.5, 150: 5.3, 300: 5.0}),
        *_curve("rung1", {50: 6.2, 100: 5.8}),
        *_curve("rung2", {50: 6.1, 100: 5.6, 150: 5.4}),
        *_curve("offgrid", {60: 6.3, 110: 5.9}),  # evaluated off the others' grid
        *_curve("nan", {50: 7.0, 100: math.nan}),
        *_curve("err", {50: 6.5}),
        *_curve("running", {50: 6.4, 100: 5.7, 120: 5.65}),
        *_curve("young", {50: 6.6}),
    ]
    common = common_tokens(trials, curves)
    assert common.tokens == 100 * K
    assert common.losses == {"full": 5.5, "rung1": 5.8, "rung2": 5.6, "offgrid": 6.3, "running": 5.7}
    assert common.left_out == ("none",)
    assert common.title == "val loss at 102k tokens, 5 trials" and common.label == "val loss at 102k tokens"

    later = common_tokens(trials, curves, tokens=150 * K)  # a chosen budget: who reached it
    assert later.losses == {"full": 5.3, "rung2": 5.4}
    assert later.left_out == ("rung1", "offgrid", "none")
    assert common_tokens([], []) == CommonTokens(0, {}, ())
    nothing = common_tokens(trials[-1:], [])
    assert (nothing.tokens, nothing.losses, nothing.left_out) == (0, {}, ("none",))


def _made_up_sweep(n: int, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`n` trials of the quickstart space whose loss depends on lr only (best at 3e-3), plus a
    little noise; a third run to 300k tokens, the rest stop at ASHA's first rung (100k); every
    fourth chose weight decay 0."""
    rng = random.Random(seed)
    trials, curves = [], []
    for i in range(n):
        lr = 10 ** rng.uniform(math.log10(3e-4), math.log10(3e-2))
        zero = i % 4 == 3
        at_rung = 5.5 + 2 * (math.log10(lr) - math.log10(3e-3)) ** 2 + rng.gauss(0, 0.01)
        status = "completed" if i % 3 == 0 else "stopped early"
        steps = {
            50: at_rung + 0.5,
            100: at_rung,
            **({200: at_rung - 0.3, 300: at_rung - 0.4} if i % 3 == 0 else {}),
        }
        config = {
            "optim.lr": lr,
            "optim.weight_decay_is_zero": zero,
            "optim.weight_decay": 0.0 if zero else 10 ** rng.uniform(-3, math.log10(0.3)),
            "optim.warmup": rng.uniform(0, 0.3),
        }
        tid = f"t{i:02d}"
        trials.append(_trial(tid, status, steps[max(steps)], config=config, tokens=float(max(steps) * K)))
        curves += _curve(tid, steps)
    trials.sort(key=lambda t: t["val_loss"])
    return trials, curves


def test_analysis_study_values_trials_at_the_common_token_count() -> None:
    space = parse_space(load_experiment(QUICKSTART))
    trials, curves = _made_up_sweep(8)
    common = common_tokens(trials, curves)
    study = analysis_study(common, trials, space)
    assert len(study.trials) == 8
    for frozen in study.trials:
        tid = frozen.user_attrs["trial_id"]
        config = next(t["config"] for t in trials if t["trial_id"] == tid)
        assert frozen.value == common.losses[tid]  # not its final loss
        assert frozen.params["lr"] == config["optim.lr"] and frozen.params["warmup"] == config["optim.warmup"]
        assert frozen.params["weight_decay=0"] is config["optim.weight_decay_is_zero"]
        assert ("weight_decay" in frozen.params) is not config["optim.weight_decay_is_zero"]


def test_parallel_coordinates_label_a_chosen_zero_0_not_none() -> None:
    space = parse_space(load_experiment(QUICKSTART))
    trials, curves = _made_up_sweep(8)  # trial 3 and 7 chose weight decay 0
    common = common_tokens(trials, curves)
    fig = parallel_figure(analysis_study(common, trials, space), common)
    labels = [note.text for note in fig.layout.annotations]
    assert "None" not in labels and "0" in labels
    hover = [value for trace in fig.data if trace.customdata is not None for _, value in trace.customdata]
    assert "None" not in hover and hover.count("0") == 2


def test_importances_come_with_intervals_or_say_they_cannot() -> None:
    space = parse_space(load_experiment(QUICKSTART))
    trials, curves = _made_up_sweep(40)
    common = common_tokens(trials, curves)
    ranked = importances(analysis_study(common, trials, space), resamples=60)
    assert ranked.n_trials == 40 and list(ranked.point)[0] == "lr"  # the loss depends on lr alone
    assert set(ranked.point) == {"lr", "weight_decay", "weight_decay=0", "warmup"}
    for name, value in ranked.point.items():
        assert 0 <= ranked.low[name] <= value <= ranked.high[name] <= 1, name
    assert ranked.low["lr"] > max(ranked.high[k] for k in ("warmup", "weight_decay=0"))
    assert ranked.note.startswith("Intervals: the middle 90%")

    few = importances(analysis_study(common_tokens(trials[: MIN_TRIALS - 1], curves), trials, space))
    assert (few.n_trials, few.point, few.low, few.high) == (MIN_TRIALS - 1, {}, {}, {})
    assert few.note == too_few(MIN_TRIALS - 1)
    assert "19 trials compared: too few" in few.note and "cannot be told apart from noise" in few.note


class Page(HTMLParser):
    """What a browser would load from report.html: every src/href, each element's id, and the
    text of the inline scripts."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.refs: list[tuple[str, str]] = []  # (tag, src or href)
        self.ids: set[str] = set()
        self.scripts: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []  # every element, with its attributes
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        self.tags.append((tag, attr))
        self.refs += [(tag, attr[k] or "") for k in ("src", "href") if k in attr]
        if "id" in attr:
            self.ids.add(attr["id"] or "")

    def handle_data(self, data: str) -> None:
        if self.lasttag == "script" and data.strip():
            self.scripts.append(data)


def check_page(html: str, out_dir: Path, plots: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    """report.html opens offline: nothing on the page comes from elsewhere (no src or href with
    a scheme other than data:, every relative link resolves beside it), plotly.js is inlined once,
    and each of `plots` has its <div> and a Plotly.newPlot call with data. Returns each plot's
    traces."""
    page = Page(html)
    for tag, value in page.refs:
        assert not re.match(r"^(\w+:|//)", value) or value.startswith("data:image/png;base64,"), (tag, value)
        assert not (tag == "script" or tag == "link"), (tag, value)  # all inline
        if not value.startswith("data:"):
            assert (out_dir / value).exists(), (tag, value)
    assert sum("plotly.js v" in script[:200] for script in page.scripts) == 1
    figures = {}
    for match in re.finditer(r'Plotly\.newPlot\(\s*"(\w+)",\s*', html):
        figures[match[1]], _ = json.JSONDecoder().raw_decode(html, match.end())
    assert set(figures) == set(plots) and set(plots) <= page.ids, (set(figures), page.ids)
    for name, traces in figures.items():
        assert traces and all(t.get("x") is not None or t.get("dimensions") for t in traces), name
    return figures


def test_page_from_made_up_trials(tmp_path: Path) -> None:
    cfg = load_experiment(QUICKSTART)
    space = parse_space(cfg)
    trials, curves = _made_up_sweep(MIN_TRIALS + 1)  # one diverges: MIN_TRIALS compared
    trials[-1]["status"], trials[-1]["val_loss"] = "diverged", math.nan
    for t in trials:
        t["path"] = str(tmp_path / "demo" / f"trial_{t['trial_id']}")
        t["checkpoint"] = f"{t['path']}/checkpoint_000003"
        Path(t["path"]).mkdir(parents=True)
    out = tmp_path / "demo" / "report"
    out.mkdir()
    (out / "best.toml").write_text("")
    common = common_tokens(trials, curves)
    rows = trial_rows(trials, common)
    assert list(rows[0]) == COLUMNS
    assert {r["common_tokens"] for r in rows} == {100 * K}
    assert rows[-1]["status"] == "diverged" and math.isnan(rows[-1]["common_val_loss"])
    study = analysis_study(common, trials, space)
    ranked = importances(study, resamples=20)
    best = best_trial(trials)
    html = report_page(
        tmp_path / "demo", out, cfg, space, trials, rows, curves, common, study, ranked, best, None
    )
    figures = check_page(html, out, (*PLOTS, "importance"))

    # The curves: one line per trial that evaluated, hover with its values; the budget marked.
    assert len(figures["curves"]) == MIN_TRIALS + 1
    first = next(t for t in figures["curves"] if t["name"].startswith(trials[0]["trial_id"]))
    assert fmt_sci(trials[0]["config"]["optim.lr"]) in first["hovertemplate"]
    assert "common token count: 102k tokens" in html
    # Loss vs each hyperparameter: every compared trial at the budget, the completed ones'
    # final losses as their own series.
    at_budget = [t for t in figures["params"] if t.get("name", "").endswith("at 102k")]
    finals = [t for t in figures["params"] if t.get("name", "").startswith("completed: final")]
    assert sum(len(t["y"]) for t in at_budget) == 3 * MIN_TRIALS  # three panels; not the diverged
    assert sorted(finals[0]["y"]) == sorted(t["val_loss"] for t in trials if t["status"] == "completed")
    assert f"val loss at 102k tokens, {MIN_TRIALS} trials" in html
    # The table: final values and the common-budget column; readable numbers; linked trials.
    assert "<th class='at'>val loss at 102k</th>" in html
    assert f"<td>{fmt_sci(trials[0]['config']['optim.lr'])}</td>" in html and "<td>307k</td>" in html
    assert f"<a href='../trial_{trials[0]['trial_id']}/'>{trials[0]['trial_id']}</a>" in html
    assert "title='stopped by ASHA at a rung" in html and "Best trial <b>" in html
    # A checkpoint shows its folder's name in a block cut to the column's width (a cell's own
    # max-width is undefined in CSS), all of its path on hover.
    checkpoint = trials[0]["checkpoint"]
    assert f"<td class='path' title='{checkpoint}'><div>checkpoint_000003</div></td>" in html
    assert "td.path div{max-width:16em;overflow:hidden;text-overflow:ellipsis}" in html
    assert ranked.note in html


MARKUP = "<script>alert(1)</script><img src=x onerror=alert(2)>'\" onmouseover='alert(3)"


def test_every_string_on_the_page_is_escaped(tmp_path: Path) -> None:
    """Markup in whatever a sweep's files hold (a config value, the sweep's name, a trial's
    reason, checkpoint path and node) is text on the page: the only scripts are plotly.js and the
    plots', and no element gets an event handler."""
    cfg = load_experiment(QUICKSTART)
    cfg = apply_overrides(cfg, {"data.dir": MARKUP, "sweep.space": {"data.dir": {"choice": [MARKUP, "x"]}}})
    space = parse_space(cfg)
    trials, curves = _made_up_sweep(8)
    for t in trials:
        t["config"]["data.dir"] = MARKUP
        t.update(reason=MARKUP, node_id=MARKUP, checkpoint=f"/sweeps/{MARKUP}")
    exp_dir = tmp_path / "<b onmouseover=alert(4)>"
    common = common_tokens(trials, curves)
    rows = trial_rows(trials, common)
    study = analysis_study(common, trials, space)
    ranked = importances(study, resamples=20)
    html = report_page(
        exp_dir, tmp_path, cfg, space, trials, rows, curves, common, study, ranked, best_trial(trials), None
    )
    page = Page(html)
    plots = re.findall(r"Plotly\.newPlot\(", html)
    assert [tag for tag, _ in page.tags].count("script") == 1 + len(plots) and plots
    assert not [(tag, a) for tag, attrs in page.tags for a in attrs if a.startswith("on")]
    assert "dir=&lt;script&gt;alert(1)&lt;/script&gt;" in html  # the baseline config, as text


def test_page_says_why_plots_are_missing(tmp_path: Path) -> None:
    """One trial: no contour, no parallel coordinates, no importances, and the page says why."""
    cfg = load_experiment(QUICKSTART)
    space = parse_space(cfg)
    trials, curves = _made_up_sweep(1)
    common = common_tokens(trials, curves)
    study = analysis_study(common, trials, space)
    html = report_page(
        tmp_path,
        tmp_path,
        cfg,
        space,
        trials,
        trial_rows(trials, common),
        curves,
        common,
        study,
        importances(study),
        None,
        None,
    )
    check_page(html, tmp_path, ("curves", "params"))
    assert html.count("Needs two trials compared at the common token count; there are 1.") == 2
    assert too_few(1) in html and "no best config" in html


def _trial_dirs(exp_dir: Path) -> list[Path]:
    return [p for p in exp_dir.iterdir() if p.is_dir() and p.name.startswith("trial_")]


def test_report_writes_every_file(finished_sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = run_cli("report", str(finished_sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "val_loss" in proc.stdout and "best trial" in proc.stdout
    assert f"study: optuna-dashboard sqlite:///{(finished_sweep / 'optuna.db').resolve()}\n" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].endswith(str(out / "report.html"))
    for name in (*FILES, "noise.png"):
        assert (out / name).is_file(), name
    for name in (*PNGS, "noise.png"):
        image = imread(out / name)
        assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 400, (name, image.shape)
    # 6 trials: no importances, and the report says why.
    assert not (out / "importance.png").exists() and f"importances: {too_few(6)}" in proc.stdout

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
    curves = pq.read_table(out / "curves.parquet").to_pylist()
    assert len(curves) >= 6

    # The common token count: ASHA's first rung, the last token count of the earliest stopped trial;
    # each trial's loss there is its curve's value at that point, whatever its final loss.
    budget = min(r["tokens"] for r in rows)
    assert {r["common_tokens"] for r in rows} == {budget} and budget < max(r["tokens"] for r in rows)
    for r in rows:
        at = {c["tokens"]: c["val_loss"] for c in curves if c["trial_id"] == r["trial_id"]}
        assert r["common_val_loss"] == at[budget], r
    assert f"compared at {fmt_tokens(budget)} tokens" in proc.stdout

    best = next(r for r in rows if r["status"] in ("completed", "stopped early", "cut by budget"))
    cfg = load_experiment(out / "best.toml")
    assert cfg.optim.lr == best["lr"] and cfg.optim.weight_decay == best["weight_decay"]
    assert cfg.optim.warmup == best["warmup"]
    assert cfg.train.out == "runs/finished-best"
    assert cfg.train.max_steps == load_experiment(finished_sweep / "gptrun.toml").train.max_steps

    page = (out / "report.html").read_text()
    check_page(page, out, PLOTS)
    for name in (*PNGS, "noise.png"):  # held in the page: it is mailed alone
        assert base64.b64encode((out / name).read_bytes()).decode() in page, name
    assert "<a href='curves.png'>" not in page
    checkpoint = rows[0]["checkpoint"]  # cut to its column's width (CSS), the full path on hover
    assert f"<td class='path' title='{checkpoint}'><div>{Path(checkpoint).name}</div></td>" in page
    for r in rows:  # each trial links to its own folder
        assert (
            f"/{finished_sweep.name}/{_trial_dir(finished_sweep, r['trial_id'])}/'>{r['trial_id']}</a>"
            in page
        )
    assert best["trial_id"] in page and "checkpoint" in page
    assert f"<td title='{rows[0]['node_id']}'>{rows[0]['node_id'][:8]}</td>" in page
    assert "ran with the baseline config" in page and too_few(6) in page


def _trial_dir(exp_dir: Path, trial_id: str) -> str:
    return next(p.name for p in _trial_dirs(exp_dir) if trial_id in p.name)


def _copy_with_trials(finished_sweep: Path, copy: Path, edit: Any) -> None:
    """A copy of the sweep (no report, no study) whose Tune state's trials go through `edit`:
    a list of (trial dict, rest of its entry) -> the list to keep."""
    shutil.copytree(finished_sweep, copy, ignore=shutil.ignore_patterns("report", "best.toml", "optuna.db"))
    state_file = sorted(copy.glob("experiment_state-*.json"))[-1]
    state = json.loads(state_file.read_text())
    entries = [(json.loads(entry[0]), entry[1:]) for entry in state["trial_data"]]
    state["trial_data"] = [[json.dumps(trial), *rest] for trial, rest in edit(entries)]
    state_file.write_text(json.dumps(state))


def test_report_one_trial(finished_sweep: Path, tmp_path: Path) -> None:
    copy = tmp_path / "finished"
    _copy_with_trials(finished_sweep, copy, lambda entries: entries[:1])
    proc = run_cli("report", str(copy))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pq.read_table(copy / "report" / "trials.parquet").to_pylist()
    assert len(rows) == 1 and rows[0]["common_val_loss"] == rows[0]["val_loss"]  # compared at its own end
    page = (copy / "report" / "report.html").read_text()
    check_page(page, copy / "report", ("curves", "params"))
    assert "Needs two trials compared at the common token count; there are 1." in page and too_few(1) in page


def test_report_every_trial_failed(finished_sweep: Path, tmp_path: Path) -> None:
    def fail(entries: list[tuple[dict[str, Any], list[Any]]]) -> list[tuple[dict[str, Any], list[Any]]]:
        for trial, _ in entries:
            trial["status"] = "ERROR"
        return entries

    copy = tmp_path / "finished"
    _copy_with_trials(finished_sweep, copy, fail)
    proc = run_cli("report", str(copy))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no trial has finished without error yet; no best.toml written" in proc.stdout
    out = copy / "report"
    assert not (out / "best.toml").exists() and (out / "curves.png").is_file()
    assert not (out / "params.png").exists()  # nothing to compare
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    assert {r["status"] for r in rows} == {"error"} and all(math.isnan(r["common_val_loss"]) for r in rows)
    page = (out / "report.html").read_text()
    check_page(page, out, ("curves",))
    assert "No trial has an evaluation to compare yet." in page and "no best config" in page
    assert page.count("Needs two trials compared at the common token count; there are 0.") == 3


def test_report_imports_no_tuner_ray_train_run_or_torch(finished_sweep: Path, tmp_path: Path) -> None:
    """`gptrun report` reads files and starts no Ray: running it on a finished sweep imports
    neither the Tuner module nor what runs trials (the trial function, our Ray Train module,
    Ray's TorchTrainer, torch), nor `gptrun confirm`. (Ray's `ray.train` package itself comes with
    `ray.tune`, whose ExperimentAnalysis reads Tune's saved state.)"""
    heavy = ["experiments.tuner", "experiments.trial", "experiments.ray_train", "experiments.confirm"]
    heavy += ["experiments.sweep", "ray.train.torch", "torch"]
    code = (
        "import json, sys\n"
        "from experiments.report import report_cli\n"
        f"assert report_cli({str(finished_sweep)!r}, {str(tmp_path)!r}) == 0\n"
        f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "report.html").is_file()
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


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
    """A trial Tune's last state holds as running, and no study (gone with a killed driver, or a
    PostgreSQL server that is down): the report reads Tune's files only."""

    def interrupt(entries: list[tuple[dict[str, Any], list[Any]]]) -> list[tuple[dict[str, Any], list[Any]]]:
        entries[-1][0]["status"] = "RUNNING"
        return entries

    copy = tmp_path / "finished"
    _copy_with_trials(finished_sweep, copy, interrupt)
    running = json.loads(
        json.loads(sorted(copy.glob("experiment_state-*.json"))[-1].read_text())["trial_data"][-1][0]
    )

    proc = run_cli("report", str(copy))  # default --out: EXPERIMENT_DIR/report
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = copy / "report"
    for name in FILES:
        assert (out / name).is_file(), name
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    assert len(rows) == 6
    assert {r["trial_id"]: r["status"] for r in rows}[running["trial_id"]] == "unfinished"
    assert "unfinished" in proc.stdout
    page = (out / "report.html").read_text()
    check_page(page, out, PLOTS)
    assert "<tr class='unfinished'>" in page


@pytest.mark.parametrize("library", ["matplotlib", "plotly"])
def test_report_needs_its_plotting_libraries(finished_sweep: Path, tmp_path: Path, library: str) -> None:
    blocker = tmp_path / "block" / library
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(f"raise ImportError('{library} blocked by the test')\n")
    pythonpath = f"{blocker.parent}:{Path(__file__).resolve().parents[1]}"
    proc = run_cli(
        "report", str(finished_sweep), "--out", str(tmp_path / "r"), env={"PYTHONPATH": pythonpath}
    )
    assert_user_error(proc, library, "pip install 'gptrun[report]'")
    assert not (tmp_path / "r").exists()


def test_report_not_an_experiment(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a sweep")
    assert_user_error(run_cli("report", str(tmp_path)), str(tmp_path), "not a gptrun sweep folder")


@pytest.mark.parametrize("damage", ["experiment_state", "sweep.json"])
def test_report_on_a_damaged_sweep_is_one_line(finished_sweep: Path, tmp_path: Path, damage: str) -> None:
    """A truncated Tune state, or a `sweep.json` that is not JSON, names the file and what to do."""
    copy = tmp_path / "damaged"
    shutil.copytree(finished_sweep, copy, ignore=shutil.ignore_patterns("report"))
    if damage == "sweep.json":
        (copy / "sweep.json").write_text("{not json")
        needle = f"{copy}/sweep.json is damaged"
    else:
        state = sorted(copy.glob("experiment_state-*.json"))[-1]
        state.write_text(state.read_text()[:200])
        needle = f"Tune's saved state {state} is damaged"
    assert_user_error(run_cli("report", str(copy), "--out", str(tmp_path / "r")), needle, "--restart")
    assert not (tmp_path / "r").exists()


STATE = "experiment_state-2026-01-01_00-00-00.json"


def _empty_sweep(tmp_path: Path) -> Path:
    """A made-up sweep folder whose Tune state holds no trial yet (report reads it in a second)."""
    exp_dir = tmp_path / "sweep"
    start_experiment(exp_dir, load_experiment(QUICKSTART), {"max_concurrent": 1})
    (exp_dir / STATE).write_text(json.dumps({"trial_data": []}))
    return exp_dir


def test_a_report_folder_that_cannot_be_written_is_one_line_before_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sysfs takes no new folder, not even root's: refused before anything is printed."""
    assert main(["report", str(_empty_sweep(tmp_path)), "--out", "/sys/gptrun/report"]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and "--out /sys/gptrun/report is not writable" in err, err


TRIAL = {"trial_id": "a1", "status": "TERMINATED", "config": {}, "relative_logdir": "trial_a1"}


@pytest.mark.parametrize(
    "name, text, needle",
    [
        (STATE, json.dumps({"trial_data": [[json.dumps(TRIAL), "{}"]]})[:40], "Tune's saved state"),
        (STATE, json.dumps({"trial_data": [[json.dumps(TRIAL), "[]"]]}), "Tune's saved state"),
        (STATE, json.dumps({"trial_data": [[json.dumps(TRIAL)]]}), "Tune's saved state"),
        (STATE, "[]", "Tune's saved state"),
        ("sweep.json", "{not json", "not a JSON object"),
        ("sweep.json", '{"max_concurrent": 1}', "trial_tokens is None, not a positive integer"),
        ("sweep.json", '{"trial_tokens": "2048"}', "trial_tokens is '2048', not a positive integer"),
        ("noise.json", '{"candidates": [', "gptrun confirm"),
    ],
    ids=[
        "state-cut-short",
        "state-trial-metadata-not-an-object",
        "state-trial-metadata-missing",
        "state-not-an-object",
        "sweep.json-not-json",
        "sweep.json-no-budget",
        "sweep.json-budget-as-text",
        "noise.json-cut-short",
    ],
)
def test_a_damaged_file_of_a_sweep_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, needle: str
) -> None:
    """Each file `report` reads, cut short or not in the shape gptrun and Tune write, is one line
    naming it and what to do, exit 2, and no report file is written (a made-up sweep folder)."""
    exp_dir = _empty_sweep(tmp_path)
    (exp_dir / name).write_text(text)
    assert main(["report", str(exp_dir), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{exp_dir / name} is damaged" in err and needle in err, err
    assert not (tmp_path / "r").exists()


class Planted:
    """A pickle that runs code when loaded: it creates the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_report_unpickles_nothing_that_tune_saved(finished_sweep, tmp_path):
    """Whoever can write to a sweep's folder cannot run code as whoever reports on it: with
    every pickle Tune saved replaced by one that runs code (its .pkl files, and the cloudpickle
    blobs inside experiment_state-*.json), `gptrun report` still writes the report, and none ran
    (`experiments.tune_state`). `gptrun resume` does unpickle them: docs/cluster.md says so."""
    import pickle

    copy = tmp_path / "finished"
    shutil.copytree(finished_sweep, copy)
    marker = tmp_path / "planted-code-ran"
    planted = pickle.dumps(Planted(marker))
    pickles = list(copy.glob("*.pkl"))
    assert pickles
    for path in pickles:
        path.write_bytes(planted)
    for path in copy.glob("experiment_state-*.json"):
        state = json.loads(path.read_text())
        for entry in state["trial_data"]:
            trial = json.loads(entry[0])
            trial["storage"] = {"_type": "CLOUDPICKLE_FALLBACK", "value": planted.hex()}
            entry[0] = json.dumps(trial)
        path.write_text(json.dumps(state))
    proc = run_cli("report", str(copy), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "report" / "report.html").is_file()
    assert not marker.exists()
    pickle.loads(planted)  # what a reader that unpickled them would have done
    assert marker.exists()
