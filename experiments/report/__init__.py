"""`gptrun report`: a sweep as a terminal table, parquet/CSV files, PNG plots, an interactive
report.html and best.toml, and the optuna-dashboard command that opens the sweep's study. It
starts no Ray cluster (it reads the sweep's files), so it works on a running or interrupted sweep
too. Trials are compared at a common token count (`common`), importances come with intervals
(`importance`); `data` builds the rows and writes the tables, `plots` draws the PNGs,
`interactive` the page's plots, `page` writes the HTML; `report_cli` runs them in that order."""

from __future__ import annotations

from pathlib import Path

from experiments.experiment import STUDY_FILE, open_experiment, study_url
from experiments.noise import print_noise
from experiments.outcome import best_trial
from experiments.ray_config import load_experiment
from experiments.remote import is_uri
from experiments.report.common import analysis_study, common_tokens
from experiments.report.importance import importances
from experiments.report.interactive import check_plotly
from experiments.report.page import report_page, warm_start_html
from experiments.report.plots import draw_importance, draw_noise, draw_sweep, figure_factory
from experiments.report.tables import read_noise, trial_rows, write, write_tables
from experiments.results import best_config, load_curves, load_trials, print_table
from experiments.scale import fit_cli, is_series
from experiments.space import parse_space
from experiments.study_db import dashboard_command
from experiments.table import fmt_tokens
from experiments.warm_start import report_history
from gptcore.atomic import check_writable_dir
from gptcore.errors import UserError


def report_cli(experiment_dir: str, out: str | None) -> int:
    """Print the table, write every report file into `out` (default EXPERIMENT_DIR/report; for an
    experiment in object storage, NAME-report in the current folder: the report is local)."""
    exp_dir = open_experiment(experiment_dir)  # a URI: its working copy, after a bucket check
    if is_series(exp_dir):  # a `gptrun scale` series: its runs, fits and plot, in its folder
        if out:
            raise UserError(
                f"{exp_dir} is a series: its report (fits.json, scaling.png) is written in it; drop --out"
            )
        return fit_cli(str(exp_dir))
    trials = load_trials(exp_dir)  # UserError for a folder that is not a sweep
    noise = read_noise(exp_dir)  # every file read before any is written
    figure = figure_factory()  # UserError without matplotlib or plotly, before anything is written
    check_plotly()
    cfg = load_experiment(exp_dir / "gptrun.toml")
    space = parse_space(cfg)
    default = Path(f"{exp_dir.name}-report") if is_uri(experiment_dir) else exp_dir / "report"
    out_dir = Path(out) if out else default
    check_writable_dir(out_dir, "--out" if out else "the report folder (--out)")  # before the table
    curves = load_curves(exp_dir)
    common = common_tokens(trials, curves)
    print_table(trials, space, common)
    left = f"; left out (no evaluation by then): {', '.join(common.left_out)}" if common.left_out else ""
    n = len(common.losses)
    print(f"compared at {fmt_tokens(common.tokens)} tokens (the most all reached): {n} trials{left}")

    rows = trial_rows(trials, common)
    write_tables(rows, curves, out_dir)
    best = best_trial(trials)
    if best is not None:
        best_cfg = best_config(cfg, space, best, exp_dir.name)
        write(out_dir / "best.toml", lambda tmp: tmp.write_text(best_cfg.to_toml()))
        print(
            f"best trial {best['trial_id']}: val loss {best['val_loss']:.4f} | config "
            f"{out_dir / 'best.toml'} | checkpoint {best['checkpoint'] or '-'}"
        )
    else:
        (out_dir / "best.toml").unlink(missing_ok=True)
        print("no trial has finished without error yet; no best.toml written")

    if cfg.sweep.storage_url or (exp_dir / STUDY_FILE).exists():
        print(f"study: {dashboard_command(study_url(cfg, exp_dir))}")
    best_id = best["trial_id"] if best else None
    draw_sweep(figure, trials, curves, common, space, best_id, out_dir)
    study = analysis_study(common, trials, space)
    ranked = importances(study)
    draw_importance(figure, ranked, common, out_dir)
    print(f"importances: {ranked.note or ', '.join(f'{k} {v:.2f}' for k, v in ranked.point.items())}")
    (out_dir / "noise.png").unlink(missing_ok=True)  # never leave a stale one behind
    if noise is not None:
        print_noise(noise)
        draw_noise(figure, noise, out_dir)
    history, history_line = report_history(cfg, exp_dir)
    if history_line:
        print(history_line)

    page = report_page(
        exp_dir, out_dir, cfg, space, trials, rows, curves, common, study, ranked, best, noise,
        warm_start=warm_start_html(history, history_line),
    )  # fmt: skip
    write(out_dir / "report.html", lambda tmp: tmp.write_text(page, encoding="utf-8"))
    print(f"report: {(out_dir / 'report.html').resolve()}")
    return 0
