"""`gptrun report`: a sweep as a table, parquet/CSV files, PNG plots, one static report.html and
best.toml. It reads files only (no Ray cluster, no server) and works on interrupted sweeps too.
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.confirm import NOISE_FILE, print_noise, verdict
from experiments.results import load_curves, load_trials, print_table, short_params
from experiments.space import Space, apply_overrides, parse_space
from gptcore.atomic import atomic_file
from gptcore.config import ExperimentConfig, load_config
from gptcore.errors import UserError

OK = ("completed", "stopped early")
COLUMNS = ("tokens", "val_loss", "best_val_loss", "val_bpb", "status", "wall_s", "checkpoint",
           "reason")
CURVE_COLUMNS = ("trial_id", "tokens", "step", "loss", "val_loss", "lr", "tokens_per_sec")
LINE = {"completed": dict(ls="-", alpha=0.9), "stopped early": dict(color="grey", ls="--", alpha=0.6),
        "unfinished": dict(color="tab:orange", ls=":", lw=2), "diverged": dict(color="k", ls=":"),
        "error": dict(color="k", ls=":")}
MARKER = {"completed": "o", "stopped early": "v", "unfinished": "X", "diverged": "x", "error": "x"}
PLOTS = (("curves.png", "Validation loss vs tokens"), ("lr.png", "Final loss vs learning rate"),
         ("warmup.png", "Final loss vs warmup"), ("parallel.png", "Parallel coordinates"))


def report_cli(experiment_dir: str, out: str | None) -> int:
    """Print the table, write every report file into `out` (default EXPERIMENT_DIR/report)."""
    exp_dir = Path(experiment_dir)
    trials = load_trials(exp_dir)  # UserError for a folder that is not a sweep
    figure = _figure_factory()
    cfg = load_config(exp_dir / "gptrun.toml")
    space = parse_space(cfg)
    out_dir = Path(out) if out else exp_dir / "report"
    print_table(trials)

    rows = trial_rows(trials)
    names = rows[0] if rows else ("rank", "trial_id", "lr", "weight_decay", "warmup", *COLUMNS)
    _write_table({k: [r[k] for r in rows] for k in names}, out_dir, "trials")
    curves = load_curves(exp_dir)
    _write_table({k: [c[k] for c in curves] for k in CURVE_COLUMNS}, out_dir, "curves")

    ok = [t for t in trials if t["status"] in OK and not math.isnan(t["val_loss"])]
    best = min(ok, key=lambda t: t["val_loss"]) if ok else None
    if best is not None:
        best_cfg = apply_overrides(cfg, space.overrides(best["config"]))
        best_cfg = apply_overrides(best_cfg, {"train.out": f"runs/{exp_dir.name}-best"})
        _write(out_dir / "best.toml", lambda tmp: tmp.write_text(best_cfg.to_toml()))
        print(f"best trial {best['trial_id']}: val loss {best['val_loss']:.4f} | config "
              f"{out_dir / 'best.toml'} | checkpoint {best['checkpoint'] or '-'}")
    else:
        (out_dir / "best.toml").unlink(missing_ok=True)
        print("no trial has finished without error yet; no best.toml written")

    best_id = best["trial_id"] if best else None
    _save(_plot_curves(figure(), trials, curves, best_id), out_dir / "curves.png")
    _save(_plot_scatter(figure(), trials, "lr", best_id, log=True), out_dir / "lr.png")
    _save(_plot_scatter(figure(), trials, "warmup", best_id), out_dir / "warmup.png")
    _save(_plot_parallel(figure(), trials, space, best_id), out_dir / "parallel.png")
    note = _importance(figure, exp_dir, cfg, out_dir)
    noise = _baseline_note(cfg, space, trials) + (_noise_section(figure, exp_dir, out_dir)
                                                  or _unmeasured_note(exp_dir))
    page = _html(exp_dir, trials, rows, best, note, noise)
    _write(out_dir / "report.html", lambda tmp: tmp.write_text(page, encoding="utf-8"))
    print(f"report: {(out_dir / 'report.html').resolve()}")
    return 0


def trial_rows(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per trial (best first): rank, id, hyperparameters, tokens, losses, status."""
    names = {k for t in trials for k in short_params(t["config"])}
    params = ["lr", "weight_decay", "warmup", *sorted(names - {"lr", "weight_decay", "warmup"})]
    rows = []
    for rank, t in enumerate(trials, 1):
        p = short_params(t["config"])
        rows.append({"rank": rank, "trial_id": t["trial_id"], **{k: p.get(k) for k in params},
                     **{k: t[k] for k in COLUMNS}})
    return rows


def _write_table(columns: dict[str, list[Any]], out_dir: Path, stem: str) -> None:
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet as pq

    table = pa.table({k: pa.array(v) for k, v in columns.items()})
    _write(out_dir / f"{stem}.parquet", lambda tmp: pq.write_table(table, tmp))
    if stem == "trials":
        _write(out_dir / f"{stem}.csv", lambda tmp: pyarrow.csv.write_csv(table, tmp))


def _write(path: Path, writer: Callable[[Path], Any]) -> None:
    """Write `path` whole or not at all, readable by others (it is a report to share)."""
    with atomic_file(path) as tmp:
        writer(tmp)
        tmp.chmod(0o644)


def _figure_factory() -> Any:
    """A function making (figure, axes) on the Agg canvas; UserError if matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("gptrun report draws its plots with matplotlib, which is not installed; "
                        "run: pip install 'gptrun[report]'") from None

    def make(width: float = 8.0, height: float = 5.0) -> tuple[Any, Any]:
        fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        return fig, fig.add_subplot()
    return make


def _save(fig: Any, path: Path) -> None:
    _write(path, lambda tmp: fig.savefig(tmp, format="png"))


def _style(t: dict[str, Any], best_id: str | None, i: int) -> dict[str, Any]:
    if t["trial_id"] == best_id:
        return dict(color="tab:red", lw=3, zorder=3, label=f"best {best_id}")
    return {"color": f"C{i % 10}", "lw": 1.3, **LINE[t["status"]]}


def _plot_curves(fa: tuple[Any, Any], trials: list[dict[str, Any]], curves: list[dict[str, Any]],
                 best_id: str | None) -> Any:
    fig, ax = fa
    labelled: set[str] = set()
    for i, t in enumerate(trials):
        pts = sorted((c["tokens"], c["val_loss"]) for c in curves if c["trial_id"] == t["trial_id"]
                     and c["tokens"] is not None and _finite(c["val_loss"]))
        if not pts:
            continue
        style = _style(t, best_id, i)
        if "label" not in style and t["status"] not in labelled:
            labelled.add(t["status"])
            style["label"] = t["status"]
        ax.plot(*zip(*pts, strict=True), **style)
        if t["status"] == "unfinished":
            ax.plot(*pts[-1], marker="X", color="tab:orange", ms=9)
    ax.set(xlabel="tokens", ylabel="validation loss", title="Validation loss per trial")
    ax.grid(alpha=0.3)
    if labelled or best_id:
        ax.legend(fontsize="small")
    return fig


def _plot_scatter(fa: tuple[Any, Any], trials: list[dict[str, Any]], key: str,
                  best_id: str | None, log: bool = False) -> Any:
    """Final val loss against one hyperparameter; colour = weight decay (white = 0)."""
    from matplotlib import cm, colormaps, colors

    fig, ax = fa
    pts = [(t, short_params(t["config"])) for t in trials if _finite(t["val_loss"])]
    pts = [(t, p) for t, p in pts if isinstance(p.get(key), (int, float))]
    wds = [p["weight_decay"] for _, p in pts if (p.get("weight_decay") or 0) > 0]
    norm = colors.LogNorm(min(wds), max(wds) if max(wds) > min(wds) else 10 * min(wds)) \
        if wds else None
    cmap = colormaps["viridis"]
    for status, marker in MARKER.items():
        group = [(t, p) for t, p in pts if t["status"] == status]
        if group:
            fill = [cmap(norm(p["weight_decay"])) if norm and (p.get("weight_decay") or 0) > 0
                    else "white" for _, p in group]
            ax.scatter([p[key] for _, p in group], [t["val_loss"] for t, _ in group], c=fill,
                       marker=marker, s=70, edgecolors="k", label=status, zorder=2)
    for t, p in pts:
        if t["trial_id"] == best_id:
            ax.scatter([p[key]], [t["val_loss"]], s=300, facecolors="none", edgecolors="tab:red",
                       lw=2, label=f"best {best_id}", zorder=3)
    if norm is not None:
        fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax,
                     label="weight decay (white marker = 0)")
    if log:
        ax.set_xscale("log")
    ax.set(xlabel=key, ylabel="final validation loss", title=f"Final loss vs {key}")
    ax.grid(alpha=0.3)
    if pts:
        ax.legend(fontsize="small")
    return fig


def _plot_parallel(fa: tuple[Any, Any], trials: list[dict[str, Any]], space: Space,
                   best_id: str | None) -> Any:
    """Each searched key on its own axis scaled to its range (log keys on a log scale; a chosen
    zero sits below the axis), then the final loss (0 = best, 1 = worst); colour = loss."""
    from matplotlib import colormaps

    fig, ax = fa
    losses = [t["val_loss"] for t in trials if _finite(t["val_loss"])]
    lo, hi = (min(losses), max(losses)) if losses else (0.0, 1.0)
    names = [p.key.rpartition(".")[2] for p in space.params]
    for i, t in enumerate(trials):
        values = short_params(t["config"])
        ys = [_normalize(p, values.get(n)) for p, n in zip(space.params, names, strict=True)]
        ys.append((t["val_loss"] - lo) / (hi - lo or 1.0) if _finite(t["val_loss"]) else math.nan)
        style = _style(t, best_id, i)
        if t["trial_id"] != best_id:
            style["color"] = colormaps["viridis"](ys[-1]) if _finite(ys[-1]) else "k"
        ax.plot(range(len(ys)), ys, marker="o", ms=4, **style)
    labels = [f"{n}\n{'log ' if p.kind == 'loguniform' else ''}[{p.low:.3g}, {p.high:.3g}]"
              if p.kind != "choice" else f"{n}\n{list(p.choices)}"
              for p, n in zip(space.params, names, strict=True)]
    ax.set_xticks(range(len(labels) + 1), [*labels, f"val loss\n[{lo:.4g}, {hi:.4g}]"])
    for x in range(len(labels) + 1):
        ax.axvline(x, color="k", lw=0.8)
    ax.set(ylabel="position in range (below 0: value 0)",
           title="Parallel coordinates (red = best; colour = loss, dashed = stopped early)")
    return fig


def _normalize(p: Any, value: Any) -> float:
    if value is None:
        return math.nan
    if p.kind == "choice":
        return p.choices.index(value) / max(len(p.choices) - 1, 1) if value in p.choices else math.nan
    if p.kind == "loguniform":
        return -0.1 if value <= 0 else \
            (math.log(value) - math.log(p.low)) / (math.log(p.high) - math.log(p.low))
    return (value - p.low) / (p.high - p.low)


def _importance(figure: Any, exp_dir: Path, cfg: ExperimentConfig, out_dir: Path) -> str | None:
    """Draw importance.png from the Optuna study; return why not when it cannot be drawn."""
    db = exp_dir / "optuna.db"
    (out_dir / "importance.png").unlink(missing_ok=True)  # never leave a stale one behind
    if not cfg.sweep.storage_url and not db.exists():
        return "No optuna.db in the experiment folder (the sweep has not finished), so no importances."
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=exp_dir.name,
                                  storage=cfg.sweep.storage_url or f"sqlite:///{db}")
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if len(done) < 2:
            return f"Only {len(done)} completed trial(s) in the Optuna study; importances need 2."
        importances = optuna.importance.get_param_importances(study)
    except (KeyError, ValueError, RuntimeError) as err:
        return f"Importances could not be computed: {err}"
    fig, ax = figure()
    ax.barh(list(importances)[::-1], list(importances.values())[::-1], color="tab:blue")
    ax.set(xlabel="importance (fANOVA)", title=f"Hyperparameter importance ({len(done)} trials)")
    _save(fig, out_dir / "importance.png")
    return None


def _noise_section(figure: Any, exp_dir: Path, out_dir: Path) -> str | None:
    """From `noise.json` (written by `gptrun confirm`): print it, draw noise.png, return the HTML.
    None when the noise has not been measured."""
    (out_dir / "noise.png").unlink(missing_ok=True)
    if not (exp_dir / NOISE_FILE).exists():
        return None
    noise = json.loads((exp_dir / NOISE_FILE).read_text())
    print_noise(noise)
    fig, ax = figure()
    for x, row in enumerate(noise["candidates"]):
        ax.scatter([x] * len(row["losses"]), row["losses"], color="tab:blue", zorder=2,
                   label="new seeds" if x == 0 else None)
        if _finite(row["std"]):
            ax.errorbar([x + 0.15], [row["mean"]], yerr=[row["std"]], fmt="s", color="k",
                        capsize=6, label="mean +- std" if x == 0 else None)
        ax.scatter([x - 0.15], [row["sweep_val_loss"]], marker="x", s=70, color="tab:red",
                   label="sweep run (selected)" if x == 0 else None)
    ax.set_xticks(range(len(noise["candidates"])), [r["trial_id"] for r in noise["candidates"]])
    ax.set(xlabel="config (sweep trial)", ylabel="final validation loss",
           title="Re-runs of the best configs with new seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, out_dir / "noise.png")
    esc = html.escape
    rows = "".join(f"<tr><td>{esc(r['trial_id'])}</td><td>{_cell(r['sweep_val_loss'])}</td>"
                   f"<td>{_cell(r['mean'])}</td><td>{_cell(r['std'])}</td>"
                   f"<td>{len(r['losses'])}</td></tr>" for r in noise["candidates"])
    return (f"<p>{esc(verdict(noise))}. Seed noise: std {noise['seed_std']:.4f} nats, "
            f"{noise['noise_fraction']:.0%} of the variance among the re-runs (std "
            f"{noise['spread_std']:.4f}): near 100% the top configs are indistinguishable.</p>"
            "<table><tr><th>trial</th><th>sweep loss</th><th>mean</th><th>std</th><th>runs</th>"
            f"</tr>{rows}</table><img src='noise.png' alt='noise'>")


def _baseline_note(cfg: ExperimentConfig, space: Space, trials: list[dict[str, Any]]) -> str:
    """How many trials ran the base config's own values."""
    raw = cfg.to_dict()
    base = {p.key: raw[p.key.partition(".")[0]][p.key.partition(".")[2]] for p in space.params}
    same = sum(all(_same(space.overrides(t["config"]).get(k), v) for k, v in base.items())
               for t in trials)
    values = ", ".join(f"{k.rpartition('.')[2]}={v:g}" if isinstance(v, float) else
                       f"{k.rpartition('.')[2]}={v}" for k, v in base.items())
    return f"<p>{same} trial(s) ran with the baseline config ({values}).</p>"


def _unmeasured_note(exp_dir: Path) -> str:
    return ("<p>Seed-to-seed noise has not been measured for this sweep, so differences between "
            "close trials may be noise; to measure it, re-run the best configs with new seeds "
            f"(<code>gptrun confirm {html.escape(str(exp_dir))} --top 3 --seeds 3</code>).</p>")


def _html(exp_dir: Path, trials: list[dict[str, Any]], rows: list[dict[str, Any]],
          best: dict[str, Any] | None, importance_note: str | None, noise: str) -> str:
    esc = html.escape
    counts = ", ".join(f"{n} {s}" for s, n in Counter(t["status"] for t in trials).items())
    head = "".join(f"<th>{esc(k)}</th>" for k in (rows[0] if rows else ()))
    body = "".join(f"<tr class='{r['status'].replace(' ', '-')}'>"
                   + "".join(f"<td>{esc(_cell(v))}</td>" for v in r.values()) + "</tr>"
                   for r in rows)
    best_line = (f"Best trial <b>{esc(best['trial_id'])}</b>: val loss {best['val_loss']:.4f} "
                 f"({esc(best['status'])}); config <a href='best.toml'>best.toml</a>; checkpoint "
                 f"<code>{esc(best['checkpoint'] or '-')}</code>" if best else
                 "No trial has finished without error yet, so there is no best config.")
    plots = "".join(f"<h2>{title}</h2><img src='{name}' alt='{title}'>" for name, title in PLOTS)
    imp = (f"<p>{esc(importance_note)}</p>" if importance_note else
           "<img src='importance.png' alt='hyperparameter importance'>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>gptrun sweep {esc(exp_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}} table{{border-collapse:collapse;
font-size:13px}} td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}
tr.unfinished{{background:#ffe9c7;font-style:italic}} tr.stopped-early{{color:#666}}
tr.diverged,tr.error{{color:#a00}} img{{max-width:100%}}</style></head><body>
<h1>Sweep {esc(exp_dir.name)}</h1>
<p>{len(trials)} trials: {esc(counts or 'none yet')}. Unfinished trials are highlighted.</p>
<p class="best">{best_line}</p>
<h2>Trials</h2><table><tr>{head}</tr>{body}</table>
{plots}<h2>Hyperparameter importance</h2>{imp}
<h2>Noise</h2>{noise}
</body></html>
"""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b
