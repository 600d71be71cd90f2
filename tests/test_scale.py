"""`gptrun scale`: the series planned from `[scale]` (sizes and tokens counted as documented, a
bad table refused in one line before Ray starts), run on Ray, fitted, forecast, and resumed
after its driver is killed. The fitter itself is tested on laws it must recover in
test_scaling_law.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.ray_config import load_experiment
from experiments.scale import passes_note, plan_series, price_series, read_results, width_config
from gptcore.model import GPT
from tests.conftest import REPO, assert_user_error, kill_when, run_cli, saved_trials, tiny_config_text

MUP = "mup_base_width = 64"
SCALE = "[scale]\nmin_flops = 5e8\nmax_flops = 2e9\nbudgets = 3\nwidths = [32, 64, 96]\n"


def series_config(data: Path, folder: Path, scale: str = SCALE, model: str = "mup_base_width = 64") -> Path:
    """The tests' tiny model (d_head 32) under µP, with a `[scale]` table."""
    folder.mkdir(parents=True, exist_ok=True)
    text = tiny_config_text(data, folder / "run").replace('preset = "tiny"', f'preset = "tiny"\n{model}')
    config = folder / "series.toml"
    config.write_text(f"{text}\n{scale}")
    return config


def one_line_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert main(["scale", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_plan_counts_sizes_and_tokens_as_documented(tmp_path):
    """Budgets are geometric; N is the matmul weights of the model built at that width; every
    run's tokens spend its budget at its FLOPs per token, to the nearest whole step."""
    cfg = load_experiment(series_config(tmp_path / "no-data", tmp_path))
    runs = plan_series(cfg)
    assert [r.flops for r in runs[::3]] == pytest.approx([5e8, 1e9, 2e9])
    per_step = 4 * 32
    for run in runs:
        model = GPT(width_config(cfg, run.width).model)
        assert (run.params, run.flops_per_token) == (model.matmul_params(), model.flops_per_token())
        assert run.heads == run.width // 32 and run.tokens % per_step == 0
        assert abs(run.tokens - run.flops / run.flops_per_token) <= per_step / 2
    assert len({r.run for r in runs}) == 9


def test_plan_prices_the_series_from_each_widths_measured_throughput(tiny_data, tmp_path, capsys):
    """What `--plan` prints after the runs: a few steps trained per width (the `train` tier)."""
    cfg = load_experiment(series_config(tiny_data, tmp_path))
    price_series(cfg, plan_series(cfg), cpus=2, gpus=0)
    out = capsys.readouterr().out
    assert "tokens/s per run (measured: 8 steps here): d32 " in out and ", d96 " in out, out
    assert "wall-clock, 2 runs at a time (2 CPU / 0 GPU)" in out, out


def test_the_shipped_series_plans_and_needs_its_data_to_price(capsys):
    """Its runs are listed from the config alone; the price measures them, on the data."""
    config = REPO / "experiments" / "configs" / "scale-series.toml"
    assert main(["scale", str(config), "--plan", "--set", 'data.dir="/nonexistent"']) == 2
    out, err = capsys.readouterr()
    assert "15 runs" in out and "gptrun prepare" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("scale", "model", "needle"),
    [
        (SCALE.replace("budgets = 3", "budgets = 1"), MUP, "scale.budgets=1"),
        (SCALE.replace("[32, 64, 96]", "[32, 48, 96]"), MUP, "48 is not a positive multiple"),
        (SCALE.replace("5e8", "1e3"), MUP, "less than one step"),
        (SCALE.replace("[32, 64, 96]", "[32, 64]"), MUP, "at least 3 different widths"),
        (SCALE.replace("max_flops = 2e9", "max_flops = 1e8"), MUP, "min_flops < max_flops"),
        (SCALE, "", "model.mup_base_width is 0"),
        (SCALE, "mup_base_width = 64\nd_ff = 256", "model.d_ff is set"),
        (SCALE.replace("[32, 64, 96]", '["32"]'), MUP, "list of integers"),
    ],
)
def test_a_bad_scale_table_is_one_line(tmp_path, capsys, scale, model, needle):
    config = series_config(tmp_path / "no-data", tmp_path, scale, model)
    assert needle in one_line_error(capsys, str(config), "--plan")


def test_predict_needs_a_series_and_a_budget(tmp_path, capsys):
    config = series_config(tmp_path / "no-data", tmp_path)
    assert "go with --predict" in one_line_error(capsys, str(config), "--flops", "1e12")
    assert "not a series" in one_line_error(capsys, str(tmp_path), "--predict", "--flops", "1e12")


def test_a_forecast_past_the_data_says_how_many_passes(tiny_data, tmp_path):
    """tiny_data's training split is 13,549 tokens."""
    cfg = load_experiment(series_config(tiny_data, tmp_path))
    note = passes_note(cfg, 40_000, [{"tokens": 8_000}])
    assert note is not None and "3.0 passes" in note and "at most 0.6" in note, note
    assert passes_note(cfg, 10_000, [{"tokens": 8_000}]) is None  # under one pass
    assert passes_note(cfg, 20_000, [{"tokens": 27_098}]) is None  # no more than the series made
    missing = load_experiment(series_config(tmp_path / "elsewhere", tmp_path / "b"))
    assert passes_note(missing, 40_000, [{"tokens": 8_000}]) is None


def test_a_killed_series_resumes_then_fits_and_forecasts(tiny_data, tmp_path):
    """Nine runs on Ray, each to its own length. The driver is SIGKILLed once Tune has saved two
    ended runs; the same command finishes the series without training those again, and fits it.
    The forecast's config trains the chosen width for its tokens with the series' lr."""
    config = series_config(tiny_data, tmp_path)
    series = tmp_path / "series" / "mini"
    args = ["scale", str(config), "--name", "mini", "--storage", str(tmp_path / "series")]
    ended: list[str] = []

    def two_saved_ends() -> bool:
        ended[:] = [tid for tid, (status, _) in saved_trials(series).items() if status == "TERMINATED"]
        return len(ended) >= 2

    kill_when([sys.executable, "-m", "experiments", *args], two_saved_ends, "two runs ended")
    proc = run_cli(*args, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "(resuming)" in proc.stdout and "L(N, D) = " in proc.stdout
    results = read_results(series)
    assert len(results) == 9 and all(math.isfinite(r["loss"]) for r in results), results
    events = [json.loads(line) for line in (series / "events.jsonl").read_text().splitlines()]
    for tid in ended:
        assert [e["event"] for e in events if e["trial_id"] == tid].count("start") == 1, (tid, events)
    fits = json.loads((series / "fits.json").read_text())
    assert fits["loss_fit"]["alpha"] >= 0 and len(fits["runs"]) == 9, fits
    assert (series / "scaling.png").stat().st_size > 0

    proc = run_cli("scale", str(series), "--predict", "--flops", "8e9")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    written = sorted(series.glob("forecast-*.toml"))
    assert len(written) == 1, proc.stdout
    target = load_experiment(written[0])
    assert target.model.d_model % 32 == 0 and target.model.n_layer == 2
    assert target.optim.lr == pytest.approx(3e-3) and target.model.mup_base_width == 64
    model = GPT(target.model)
    assert target.train.max_tokens == pytest.approx(8e9 / model.flops_per_token(), rel=0.05)
    assert f"gptrun train {written[0]}" in proc.stdout and "passes over the training split" in proc.stdout
    forecast = json.loads(written[0].with_suffix(".json").read_text())
    assert forecast["loss"]["low"] <= forecast["loss"]["value"] <= forecast["loss"]["high"], forecast

    proc = run_cli("report", str(series))  # a series' report: its runs, fits and plot
    assert proc.returncode == 0 and "L(N, D) = " in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_user_error(run_cli("report", str(series), "--out", str(tmp_path / "r")), "drop --out")
