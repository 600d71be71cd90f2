"""`gptrun scale`: a miniseries on the cluster, scaling laws fitted to it, and a forecast.

A series trains, at each compute budget C of a geometric series (`[scale]`), one model per width
(d_model at the config's depth and head size) for D = C / FLOPs-per-token tokens: Chinchilla's
IsoFLOP design (Hoffmann et al. 2022). Every run keeps the config's optimizer values. µP
(`model.mup_base_width`) is required: under it those values hold at every width, so a proxy's
tuned lr (`gptrun transfer`) serves the whole series, where a fixed lr without µP would favour
some sizes (Porian et al. 2024 trace part of the Kaplan-Chinchilla disagreement to exactly that).
The runs are the trials of a grid (`experiments.grid`): parallel on the cluster, each trained to
its own length, resumed after a kill by the same command.

N counts the weights a token's activations are multiplied by (`GPT.matmul_params`: the
non-embedding parameters plus the lm_head), and C uses the same count (`GPT.flops_per_token`:
6N plus attention's 12 * n_layer * d_model * seq_len), so the head's FLOPs, the other half of
Porian et al.'s account, are in both; the input embedding, a lookup, is in neither. The fits and
the forecast are `experiments.scaling_law`; this module plans, runs and reads the series.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from experiments.outcome import FLAGS
from experiments.ray_config import RayExperiment
from experiments.space import apply_overrides
from gptcore.config import run_length
from gptcore.errors import UserError

SERIES_DIR = "series"  # the default storage of a series: ./series/NAME
FITS_FILE = "fits.json"


@dataclass(frozen=True)
class SeriesRun:
    """One run of a series: its budget, its size and the tokens that spend the budget."""

    run: str  # its id in the grid, e.g. "C2-d96"
    flops: float  # the budget C it belongs to
    width: int  # d_model
    heads: int  # n_head: width / the config's head size
    params: int  # N: GPT.matmul_params
    flops_per_token: float
    tokens: int  # D, in whole steps: C / flops_per_token, rounded to the nearest step

    @property
    def overrides(self) -> dict[str, Any]:
        return {
            "model.d_model": self.width,
            "model.n_head": self.heads,
            "train.max_tokens": self.tokens,
            "train.max_steps": 0,
        }


@dataclass(frozen=True)
class SeriesSpace:
    """What a series trial's Tune config means: `run` names its `SeriesRun` (the `Space` of a
    series experiment, as `Candidates` is a confirm's)."""

    runs: dict[str, dict[str, Any]]  # run id -> config values
    keys = ("run",)

    def overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        return self.runs[config["run"]]


def budgets(cfg: RayExperiment) -> list[float]:
    """`[scale]`'s budgets, a geometric series; one line for a table that is not a series."""
    s = cfg.scale
    if s.budgets < 2:
        raise UserError(
            f"scale.budgets={s.budgets}: a series needs at least 2 budgets to fit a law across them"
        )
    if not 0 < s.min_flops < s.max_flops < math.inf:
        raise UserError(
            f"scale.min_flops={s.min_flops:g}, scale.max_flops={s.max_flops:g}: need "
            "0 < min_flops < max_flops, e.g. min_flops = 1e12, max_flops = 1e13"
        )
    ratio = (s.max_flops / s.min_flops) ** (1 / (s.budgets - 1))
    return [s.min_flops * ratio**i for i in range(s.budgets)]


def width_config(cfg: RayExperiment, width: int) -> RayExperiment:
    """The config at d_model `width`: the same depth and head size, so n_head = width / d_head;
    d_ff is derived (from the width)."""
    d_head = cfg.model.d_model // cfg.model.n_head
    if width <= 0 or width % d_head:
        raise UserError(
            f"scale.widths: {width} is not a positive multiple of the head size {d_head} "
            "(model.d_model / model.n_head); the series keeps the head size"
        )
    return apply_overrides(cfg, {"model.d_model": width, "model.n_head": width // d_head})


def size_of(cfg: RayExperiment) -> tuple[int, float]:
    """(N, training FLOPs per token) of `cfg`'s model, built on the meta device: no memory."""
    import torch

    from gptcore.model import GPT

    with torch.device("meta"):
        model = GPT(cfg.model)
    return model.matmul_params(), model.flops_per_token()


def plan_series(cfg: RayExperiment) -> list[SeriesRun]:
    """Every run of the series, checked: µP on, d_ff and n_kv_head derived (so they follow the
    width), at least three widths (a parabola per budget), each budget at least one step."""
    m = cfg.model
    if not m.mup_base_width:
        raise UserError(
            "model.mup_base_width is 0: a series varies the width, and only under µP does one lr "
            "hold at every width; set it (e.g. --set model.mup_base_width=D, the width the lr "
            "was tuned at) and use the proxy's lr (`gptrun transfer`)"
        )
    fixed = [key for key in ("d_ff", "n_kv_head") if not m.derives(key)]
    if fixed:
        raise UserError(
            f"model.{fixed[0]} is set: a series varies the width, so leave it derived from d_model"
        )
    widths = sorted(set(cfg.scale.widths))
    if len(widths) < 3:
        raise UserError(
            f"scale.widths={cfg.scale.widths}: need at least 3 different widths (each budget's "
            "loss-against-size profile is a parabola), e.g. widths = [64, 96, 128, 192]"
        )
    configs = {w: width_config(cfg, w) for w in widths}
    sizes = {w: size_of(c) for w, c in configs.items()}
    per_step = run_length(cfg, cfg.resources.workers).tokens_per_step
    runs = []
    for i, flops in enumerate(budgets(cfg), start=1):
        for w in widths:
            params, per_token = sizes[w]
            steps = round(flops / per_token / per_step)
            if steps < 1:
                raise UserError(
                    f"scale: budget {flops:.3g} FLOPs buys d_model={w} {flops / per_token:,.0f} "
                    f"tokens, less than one step ({per_step:,} tokens); raise scale.min_flops"
                )
            heads = configs[w].model.n_head
            runs.append(SeriesRun(f"C{i}-d{w}", flops, w, heads, params, per_token, steps * per_step))
    return runs


def print_series(runs: list[SeriesRun]) -> None:
    from experiments.table import print_columns

    rows = [
        [
            r.run,
            f"{r.flops:.3g}",
            str(r.width),
            f"{r.params:,}",
            f"{r.tokens:,}",
            f"{r.tokens / r.params:.1f}",
        ]
        for r in runs
    ]
    print_columns(["run", "FLOPs", "d_model", "N", "tokens", "tokens/N"], rows)
    total = sum(r.tokens for r in runs)
    print(f"{len(runs)} runs, {total:,} tokens, {sum(r.flops for r in runs):.3g} FLOPs in all")


def price_series(cfg: RayExperiment, runs: list[SeriesRun], cpus: float, gpus: float) -> None:
    """What the series will cost, as `gptrun plan` prices a sweep: each width's throughput
    measured by a short probe here, each run's tokens at it plus a trial's start-up, the runs
    scheduled longest first on as many slots as the cluster fits at once."""
    from experiments.plan import DDP_STARTUP_S, LEAN_STARTUP_S, PROBE_STEPS, probe_tokens_per_sec
    from experiments.sizing import concurrency, is_lean
    from gptcore.durations import duration

    workers = cfg.resources.workers  # a DDP run: one worker probed, its rate times the workers
    speed = {w: probe_tokens_per_sec(width_config(cfg, w)) * workers for w in sorted({r.width for r in runs})}
    startup = LEAN_STARTUP_S if is_lean(cfg) else DDP_STARTUP_S
    seconds = sorted((r.tokens / speed[r.width] + startup for r in runs), reverse=True)
    slots = [0.0] * max(1, concurrency(cfg, cpus, gpus))
    for s in seconds:  # each run to the slot that frees first
        slots[slots.index(min(slots))] += s
    rates = ", ".join(f"d{w} {v:,.0f}" for w, v in speed.items())
    print(f"tokens/s per run (measured: {PROBE_STEPS} steps here): {rates}")
    print(
        f"~{duration(max(slots))} wall-clock, {len(slots)} runs at a time "
        f"({cpus:g} CPU / {gpus:g} GPU), ~{sum(seconds) / 3600:.2f} run-hours"
    )


def read_results(exp_dir: Path) -> list[dict[str, Any]]:
    """Each planned run with its final validation loss (NaN until it finished: still running,
    diverged, refused or failed) and its status, from Tune's saved state."""
    from experiments.experiment import read_meta
    from experiments.results import load_tune_trials

    planned = {r["run"]: r for r in read_meta(exp_dir)["runs"]}
    ended = {}
    for trial in load_tune_trials(exp_dir):
        last = trial.last_result or {}
        run = planned.get(trial.config.get("run"))
        if run is None:
            continue
        flag = next((f for f in FLAGS if last.get(f)), "")  # no loss to fit
        done = trial.status == "TERMINATED" and last.get("tokens", 0) >= run["tokens"] and not flag
        ended[run["run"]] = (
            last.get("val_loss", math.nan) if done else math.nan,
            flag or trial.status.lower(),
        )
    unseen = (math.nan, "not started")
    return [
        dict(r, loss=ended.get(r["run"], unseen)[0], status=ended.get(r["run"], unseen)[1])
        for r in planned.values()
    ]


def save_json(exp_dir: Path, name: str, value: Any) -> Path:
    from gptcore.atomic import write_text_atomic

    path = exp_dir / name
    write_text_atomic(path, json.dumps(value, indent=1, default=_plain))
    return path


def _plain(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def scale_cli(
    config: str,
    overrides: list[str],
    *,
    name: str | None,
    storage: str | None,
    restart: bool,
    address: str | None,
    plan_only: bool,
) -> int:
    """Plan the series (one line for a bad `[scale]`, before Ray starts), print it, run or
    resume it, then fit it."""
    from experiments import remote
    from experiments.cluster import check_fits, check_storage, local_resources, ray_session
    from experiments.grid import resumable
    from experiments.ray_config import checked_for_workers, load_experiment
    from experiments.sizing import local_extra_cpus, trial_footprint

    cfg = load_experiment(config, overrides)
    runs = plan_series(cfg)
    print_series(runs)
    if plan_only:
        import torch

        cpus = (os.cpu_count() or 1) + local_extra_cpus(cfg)
        price_series(checked_for_workers(cfg), runs, cpus, float(torch.cuda.device_count()))
        return 0
    cfg = checked_for_workers(cfg)
    storage = check_storage(storage, SERIES_DIR)
    if remote.is_uri(storage):
        raise UserError(
            f"--storage {storage}: a series lives in a folder (shared by the nodes), not an object store"
        )
    exp_dir = Path(storage) / (name or cfg.name)
    plan = {"runs": [asdict(r) for r in runs]}
    restore = resumable(
        exp_dir,
        plan,
        restart,
        lambda saved: f"a series of {len(saved['runs'])} runs" if "runs" in saved else "another experiment",
    )
    if address is None:
        check_fits(*trial_footprint(cfg), "one run", local_resources(local_extra_cpus(cfg)))
    with ray_session(address, extra_local_cpus=local_extra_cpus(cfg)):
        run_series(cfg, runs, exp_dir, plan, restore)
    return fit_cli(str(exp_dir))


def run_series(
    cfg: RayExperiment, runs: list[SeriesRun], exp_dir: Path, plan: dict[str, Any], restore: bool
) -> None:
    """The series as a grid on the cluster, as many runs at once as fit. The experiment's base
    length is the shortest run's, so that every run that reaches its own length reads as
    completed in the trial lines (a grid has no early stopping and no budget to cut it)."""
    from experiments.autoscale import room_for
    from experiments.cluster import create_storage, verify_shared_storage, verify_trial_nodes
    from experiments.grid import run_grid
    from experiments.sizing import concurrency, trial_bundles

    base = apply_overrides(cfg, {"train.max_tokens": min(r.tokens for r in runs), "train.max_steps": 0})
    print(f"series {exp_dir}: {len(runs)} runs{' (resuming)' if restore else ''}", flush=True)
    with room_for(trial_bundles(cfg), len(runs), "one run", lambda c, g: concurrency(cfg, c, g)) as width:
        create_storage(str(exp_dir.parent))
        verify_shared_storage(str(exp_dir.parent))  # every node must see the runs' checkpoints
        verify_trial_nodes(cfg.data.dir)
        run_grid(
            base,
            SeriesSpace({r.run: r.overrides for r in runs}),
            exp_dir,
            width,
            grid={"run": [r.run for r in runs]},
            meta={**plan, "max_concurrent": width},
            restore=restore,
            tracking_name=exp_dir.name,
        )


def is_series(exp_dir: Path) -> bool:
    """Whether a folder holds a `gptrun scale` series (its sweep.json lists the runs)."""
    from experiments.experiment import META_FILE, read_meta

    return (exp_dir / META_FILE).exists() and "runs" in read_meta(exp_dir)


def open_series(series: str) -> tuple[RayExperiment, Path, list[dict[str, Any]]]:
    """A series folder's base config, path and runs with their losses; one line for a folder
    that is not a series."""
    from experiments.experiment import load_base

    exp_dir = Path(series).expanduser().resolve()
    if not is_series(exp_dir):
        raise UserError(
            f"{exp_dir} is not a series folder (no runs in sweep.json); "
            "pass the folder `gptrun scale` printed"
        )
    cfg, _ = load_base(exp_dir)
    return cfg, exp_dir, read_results(exp_dir)


def finished_runs(results: list[dict[str, Any]]) -> list[Any]:
    from experiments.scaling_law import Run

    return [Run(r["params"], r["tokens"], r["flops"], r["loss"]) for r in results if math.isfinite(r["loss"])]


def fit_cli(series: str) -> int:
    """Print the series' runs and both fits (a fit the runs cannot support is one line saying
    why), write fits.json and the plots. Exit 1 while a run has no loss."""
    from experiments.scaling_law import fit_isoflop, fit_loss
    from experiments.table import print_columns

    cfg, exp_dir, results = open_series(series)
    print_columns(
        ["run", "FLOPs", "d_model", "N", "tokens", "val loss", "status"],
        [
            [
                r["run"],
                f"{r['flops']:.3g}",
                str(r["width"]),
                f"{r['params']:,}",
                f"{r['tokens']:,}",
                f"{r['loss']:.4f}",
                r["status"],
            ]
            for r in results
        ],
    )
    runs = finished_runs(results)
    fits: dict[str, Any] = {"runs": results}
    for key, fit in (("isoflop", fit_isoflop), ("loss_fit", fit_loss)):
        try:
            fits[key] = fit(runs)
        except UserError as err:
            fits[key] = None
            print(f"{key}: not fitted: {err}")
    for line in describe_fits(fits["isoflop"], fits["loss_fit"]):
        print(line)
    save_json(exp_dir, FITS_FILE, fits)
    draw_series(exp_dir, results, fits["isoflop"], fits["loss_fit"])
    print(
        f"fits written to {exp_dir / FITS_FILE}; forecast a budget: "
        f"gptrun scale {exp_dir} --predict --flops F"
    )
    missing = [r["run"] for r in results if not math.isfinite(r["loss"])]
    if missing:
        print(
            f"{len(missing)} runs have no loss ({', '.join(missing)}); "
            "run the same `gptrun scale` again to finish them"
        )
        return 1
    return 0


def describe_fits(iso: Any, loss_fit: Any) -> list[str]:
    lines = []
    if iso is not None:
        for p in iso.profiles:
            note = f" (left out: {p.flag})" if p.flag else ""
            lines.append(
                f"IsoFLOP C = {p.flops:.3g}: N* = {p.params:.3g}, D* = {p.tokens:.3g}, "
                f"loss {p.loss:.4f}{note}"
            )
        lines.append(f"N*(C) = {iso.k_n:.3g} C^{iso.a:.3f}, D*(C) = {iso.k_d:.3g} C^{iso.b:.3f}")
    if loss_fit is not None:
        f = loss_fit
        lines.append(
            f"L(N, D) = {f.E:.3f} + {f.A:.3g}/N^{f.alpha:.3f} + {f.B:.3g}/D^{f.beta:.3f} "
            f"(residuals: {float(sum(abs(r) for r in f.residuals)) / len(f.residuals):.4f} mean |log|)"
        )
    return lines


def candidate_sizes(cfg: RayExperiment, widths: list[int]) -> list[tuple[int, int, float]]:
    """(width, N, FLOPs per token) of the family at every multiple of the head size, up to 32
    times the series' widest: the forecast picks its compute-optimal size among them."""
    d_head = cfg.model.d_model // cfg.model.n_head
    top = 32 * max(widths)
    return [(w, *size_of(width_config(cfg, w))) for w in range(d_head, top + 1, d_head)]


def run_config(cfg: RayExperiment, width: int, tokens: float) -> RayExperiment:
    """The series' config at `width`, trained for `tokens` (to the nearest whole step), its
    paths absolute so that it trains from any folder: what a forecast writes."""
    from experiments.ray_config import with_absolute_paths

    per_step = run_length(cfg, cfg.resources.workers).tokens_per_step
    whole = max(1, round(tokens / per_step)) * per_step
    target = apply_overrides(width_config(cfg, width), {"train.max_tokens": whole, "train.max_steps": 0})
    return with_absolute_paths(target)


def budget_flops(flops: float | None, gpu_hours: float | None, gpu: str, mfu: float) -> float:
    """--flops, or --gpu-hours on `gpu` at `mfu` of its dense bf16 peak."""
    from gptcore.mfu import PEAK_BF16_FLOPS

    if (flops is None) == (gpu_hours is None):
        raise UserError("--predict needs one budget: --flops F, or --gpu-hours H (with --gpu and --mfu)")
    if flops is not None:
        if flops <= 0:
            raise UserError(f"--flops {flops:g} must be positive")
        return flops
    assert gpu_hours is not None
    name = next((k for k in sorted(PEAK_BF16_FLOPS, key=len, reverse=True) if k in gpu.upper()), None)
    if name is None:
        raise UserError(f"--gpu {gpu}: no known peak; known: {', '.join(PEAK_BF16_FLOPS)}")
    if gpu_hours <= 0 or not 0 < mfu <= 1:
        raise UserError(f"--gpu-hours {gpu_hours:g} --mfu {mfu:g}: need hours > 0 and 0 < mfu <= 1")
    total = gpu_hours * 3600 * PEAK_BF16_FLOPS[name] * mfu
    print(
        f"{gpu_hours:g} {name} GPU-hours at {mfu:.0%} MFU of {PEAK_BF16_FLOPS[name] / 1e12:.0f} "
        f"TFLOP/s = {total:.3g} FLOPs"
    )
    return total


def forecast_stem(flops: float) -> str:
    """The name of a forecast's files in its series (.json, .toml): forecast-4e12."""
    return f"forecast-{flops:.3g}".replace("+", "")


def predict_cli(series: str, *, flops: float | None, gpu_hours: float | None, gpu: str, mfu: float) -> int:
    """The forecast at a budget, printed and saved, and the config that trains it (the series'
    optimizer values: µP carries them to the forecast's width), written like `transfer` writes one."""
    from experiments.scaling_law import forecast
    from gptcore.atomic import write_text_atomic

    cfg, exp_dir, results = open_series(series)
    total = budget_flops(flops, gpu_hours, gpu, mfu)
    sizes = candidate_sizes(cfg, [r["width"] for r in results])
    f = forecast(finished_runs(results), total, [(n, per_token) for _, n, per_token in sizes])
    for line in f.describe():
        print(line)
    note = passes_note(cfg, f.tokens, results)
    if note:
        print(f"  {note}")
    width = next(w for w, n, _ in sizes if n == f.params)
    target = run_config(cfg, width, f.tokens)
    tokens = target.train.max_tokens
    stem = forecast_stem(total)
    save_json(exp_dir, f"{stem}.json", f)
    out = exp_dir / f"{stem}.toml"
    write_text_atomic(out, target.to_toml())
    draw_series(exp_dir, results, f.isoflop, f.fit, f)
    print(f"config for d_model={width} ({f.params:,.0f} params, {tokens:,} tokens) written to {out}")
    print(f"train it: gptrun train {out}")
    return 0


def passes_note(cfg: RayExperiment, tokens: float, results: list[dict[str, Any]]) -> str | None:
    """A note when a forecast's tokens are more passes over the training split than any run of
    the series made: repeated tokens are worth less than new ones, which the law fitted on the
    series does not know (the check in docs/scaling.md missed by that). None when they are not,
    or when the data is not on this machine (it may live on the cluster only)."""
    from gptcore.data import TokenData

    try:
        train = TokenData(cfg.data.dir).meta["splits"]["train"]["tokens"]
    except UserError:
        return None
    passes, seen = tokens / train, max(r["tokens"] for r in results) / train
    if passes <= max(1.0, seen):
        return None
    return (
        f"note: D is {passes:.1f} passes over the training split of {cfg.data.dir} ({train:,} tokens), "
        f"the series' runs made at most {seen:.1f}: repeated tokens are worth less than new ones, "
        "and the law does not know it"
    )


def draw_series(exp_dir: Path, results: list[dict[str, Any]], iso: Any, loss_fit: Any, f: Any = None) -> None:
    """scaling.png: the IsoFLOP curves (loss against N per budget, with L(N, D) along each) and
    the compute-optimal N against C (the profiles' minima, the power law, the forecast).
    Without matplotlib (the `report` extra) a note, not an error: the fits are in fits.json."""
    import numpy as np

    from experiments.report.plots import figure_factory
    from experiments.report.tables import write

    try:
        make = figure_factory()
    except UserError:
        print("scaling.png not drawn: matplotlib is missing (pip install 'gptrun[report]')")
        return
    fig, (curves, optimal) = make(11.0, 4.5, ncols=2, sharey=False)
    budgets_seen = sorted({r["flops"] for r in results})
    for flops in budgets_seen:
        runs = sorted(
            (r for r in results if r["flops"] == flops and math.isfinite(r["loss"])),
            key=lambda r: r["params"],
        )
        (line,) = curves.plot(
            [r["params"] for r in runs], [r["loss"] for r in runs], "o", label=f"C = {flops:.2g}"
        )
        if loss_fit is not None and runs:
            n = np.geomspace(runs[0]["params"], runs[-1]["params"], 50)
            logn, logd = np.log([[r["params"] for r in runs], [r["tokens"] for r in runs]])
            d = np.exp(np.interp(np.log(n), logn, logd))
            curves.plot(n, loss_fit.loss(n, d), "-", color=line.get_color(), alpha=0.6)
    curves.set(xscale="log", xlabel="N (params)", ylabel="val loss", title="IsoFLOP profiles")
    curves.legend(fontsize=8)
    if iso is not None:
        used = [p for p in iso.profiles if not p.flag]
        optimal.plot([p.flops for p in used], [p.params for p in used], "o", label="profile minima")
        top = f.flops if f is not None else max(budgets_seen)
        c = np.geomspace(min(budgets_seen), top, 50)
        optimal.plot(c, iso.params(c), "-", label=f"N* ~ C^{iso.a:.2f}")
    if f is not None:
        optimal.errorbar([f.flops], [f.params], fmt="*", markersize=12, label="forecast (parametric)")
    optimal.set(xscale="log", yscale="log", xlabel="C (FLOPs)", ylabel="N*", title="compute-optimal size")
    if optimal.get_legend_handles_labels()[0]:
        optimal.legend(fontsize=8)
    write(exp_dir / "scaling.png", lambda tmp: fig.savefig(tmp, format="png"))
    print(f"plot: {exp_dir / 'scaling.png'}")
