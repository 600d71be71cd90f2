"""The report's PNG plots, drawn with matplotlib on the Agg canvas (no display, no pyplot state):
loss curves, final loss against lr and warmup, parallel coordinates, Optuna's importances and the
seed re-runs. Unfinished trials are drawn too: a report of a running sweep shows where it is."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from experiments.config import RayExperiment
from experiments.experiment import STUDY_FILE, study_url
from experiments.report.data import write
from experiments.results import short_params
from experiments.space import Space
from experiments.storage import rdb_storage
from gptcore.errors import UserError

PLOTS = (
    ("curves.png", "Validation loss vs tokens"),
    ("lr.png", "Final loss vs learning rate"),
    ("warmup.png", "Final loss vs warmup"),
    ("parallel.png", "Parallel coordinates"),
)
LINE = {
    "completed": dict(ls="-", alpha=0.9),
    "stopped early": dict(color="grey", ls="--", alpha=0.6),
    "cut by budget": dict(color="tab:purple", ls="-.", alpha=0.6),
    "unfinished": dict(color="tab:orange", ls=":", lw=2),
    "diverged": dict(color="k", ls=":"),
    "error": dict(color="k", ls=":"),
}
MARKER = {
    "completed": "o",
    "stopped early": "v",
    "cut by budget": "s",
    "unfinished": "X",
    "diverged": "x",
    "error": "x",
}


def figure_factory() -> Any:
    """A function making (figure, axes) on the Agg canvas. Called before anything is written, so
    that a missing matplotlib is one UserError and no half report."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "gptrun report draws its plots with matplotlib, which is not installed; "
            "run: pip install 'gptrun[report]'"
        ) from None

    def make(width: float = 8.0, height: float = 5.0) -> tuple[Any, Any]:
        fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        return fig, fig.add_subplot()

    return make


def draw_sweep(
    figure: Any,
    trials: list[dict[str, Any]],
    curves: list[dict[str, Any]],
    space: Space,
    best_id: str | None,
    out_dir: Path,
) -> None:
    """The four plots of `PLOTS` into `out_dir`, the best trial in red on each."""
    _save(_plot_curves(figure(), trials, curves, best_id), out_dir / "curves.png")
    _save(_plot_scatter(figure(), trials, "lr", best_id, log=True), out_dir / "lr.png")
    _save(_plot_scatter(figure(), trials, "warmup", best_id), out_dir / "warmup.png")
    _save(_plot_parallel(figure(), trials, space, best_id), out_dir / "parallel.png")


def draw_importance(figure: Any, exp_dir: Path, cfg: RayExperiment, out_dir: Path) -> tuple[bool, str]:
    """Draw importance.png from the Optuna study. Returns whether it was drawn, and a note for the
    report: why it was not, or how many trials it leaves out.

    ASHA lets only the better trials run to the end, so the completed trials alone say little
    about what mattered. Every trial with reports is compared instead at the largest token count
    that all of them reached (ASHA's first rung, when it stopped some), by its validation loss
    there: Optuna's PED-ANOVA on that common budget. A trial with no evaluation by then (one that
    failed before its first) is left out, and counted in the note."""
    (out_dir / "importance.png").unlink(missing_ok=True)  # never leave a stale one behind
    if not cfg.sweep.storage_url and not (exp_dir / STUDY_FILE).exists():
        return False, f"No {STUDY_FILE} in the experiment folder (no trial has started), so no importances."
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=exp_dir.name, storage=rdb_storage(study_url(cfg, exp_dir)))
        common, at_common, left_out = _at_common_budget(study.trials)
        if len(at_common.trials) < 2:
            return False, (
                f"Only {len(at_common.trials)} trial(s) with reports in the Optuna study; importances need 2."
            )
        importances = optuna.importance.get_param_importances(
            at_common, evaluator=optuna.importance.PedAnovaImportanceEvaluator()
        )
    except (KeyError, ValueError, RuntimeError, UserError) as err:  # UserError: the server is down
        return False, f"Importances could not be computed: {err}"
    fig, ax = figure()
    ax.barh(list(importances)[::-1], list(importances.values())[::-1], color="tab:blue")
    ax.set(
        xlabel="importance (PED-ANOVA)",
        title=f"Hyperparameter importance: val loss at {common:,} tokens ({len(at_common.trials)} trials)",
    )
    _save(fig, out_dir / "importance.png")
    if not left_out:
        return True, ""
    return True, (
        f"Importances leave out {left_out} finished trial(s) with no evaluation at or before "
        f"{common:,} tokens (they failed before their first)."
    )


def _at_common_budget(trials: list[Any]) -> tuple[int, Any, int]:
    """An in-memory study holding each reporting trial once, valued by its last validation loss
    at or before the largest token count that every such trial reached; that count; and how many
    finished trials it leaves out for want of a report by then."""
    import optuna

    finished = [
        t for t in trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    ]
    common = min((max(t.intermediate_values) for t in finished if t.intermediate_values), default=0)
    study = optuna.create_study(direction="minimize")
    for t in finished:
        steps = [s for s in t.intermediate_values if s <= common]
        if steps:
            study.add_trial(
                optuna.trial.create_trial(
                    params=t.params, distributions=t.distributions, value=t.intermediate_values[max(steps)]
                )
            )
    return common, study, len(finished) - len(study.trials)


def draw_noise(figure: Any, noise: dict[str, Any], out_dir: Path) -> None:
    """noise.png: each re-run's loss, mean +- std per config, and the sweep's own (selected) run."""
    fig, ax = figure()
    for x, row in enumerate(noise["candidates"]):
        ax.scatter(
            [x] * len(row["losses"]),
            row["losses"],
            color="tab:blue",
            zorder=2,
            label="new seeds" if x == 0 else None,
        )
        if _finite(row["std"]):
            ax.errorbar(
                [x + 0.15],
                [row["mean"]],
                yerr=[row["std"]],
                fmt="s",
                color="k",
                capsize=6,
                label="mean +- std" if x == 0 else None,
            )
        ax.scatter(
            [x - 0.15],
            [row["sweep_val_loss"]],
            marker="x",
            s=70,
            color="tab:red",
            label="sweep run (selected)" if x == 0 else None,
        )
    ax.set_xticks(range(len(noise["candidates"])), [r["trial_id"] for r in noise["candidates"]])
    ax.set(
        xlabel="config (sweep trial)",
        ylabel="final validation loss",
        title="Re-runs of the best configs with new seeds",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, out_dir / "noise.png")


def _save(fig: Any, path: Path) -> None:
    write(path, lambda tmp: fig.savefig(tmp, format="png"))


def _style(t: dict[str, Any], best_id: str | None, i: int) -> dict[str, Any]:
    if t["trial_id"] == best_id:
        return dict(color="tab:red", lw=3, zorder=3, label=f"best {best_id}")
    return {"color": f"C{i % 10}", "lw": 1.3, **LINE[t["status"]]}


def _plot_curves(
    fa: tuple[Any, Any], trials: list[dict[str, Any]], curves: list[dict[str, Any]], best_id: str | None
) -> Any:
    fig, ax = fa
    labelled: set[str] = set()
    for i, t in enumerate(trials):
        pts = sorted(
            (c["tokens"], c["val_loss"])
            for c in curves
            if c["trial_id"] == t["trial_id"] and c["tokens"] is not None and _finite(c["val_loss"])
        )
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


def _plot_scatter(
    fa: tuple[Any, Any], trials: list[dict[str, Any]], key: str, best_id: str | None, log: bool = False
) -> Any:
    """Final val loss against one hyperparameter; colour = weight decay (white = 0)."""
    from matplotlib import cm, colormaps, colors

    fig, ax = fa
    pts = [(t, short_params(t["config"])) for t in trials if _finite(t["val_loss"])]
    pts = [(t, p) for t, p in pts if isinstance(p.get(key), (int, float))]
    wds = [p["weight_decay"] for _, p in pts if (p.get("weight_decay") or 0) > 0]
    norm = colors.LogNorm(min(wds), max(wds) if max(wds) > min(wds) else 10 * min(wds)) if wds else None
    cmap = colormaps["viridis"]
    for status, marker in MARKER.items():
        group = [(t, p) for t, p in pts if t["status"] == status]
        if group:
            fill = [
                cmap(norm(p["weight_decay"])) if norm and (p.get("weight_decay") or 0) > 0 else "white"
                for _, p in group
            ]
            ax.scatter(
                [p[key] for _, p in group],
                [t["val_loss"] for t, _ in group],
                c=fill,
                marker=marker,
                s=70,
                edgecolors="k",
                label=status,
                zorder=2,
            )
    for t, p in pts:
        if t["trial_id"] == best_id:
            ax.scatter(
                [p[key]],
                [t["val_loss"]],
                s=300,
                facecolors="none",
                edgecolors="tab:red",
                lw=2,
                label=f"best {best_id}",
                zorder=3,
            )
    if norm is not None:
        fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="weight decay (white marker = 0)")
    if log:
        ax.set_xscale("log")
    ax.set(xlabel=key, ylabel="final validation loss", title=f"Final loss vs {key}")
    ax.grid(alpha=0.3)
    if pts:
        ax.legend(fontsize="small")
    return fig


def _plot_parallel(
    fa: tuple[Any, Any], trials: list[dict[str, Any]], space: Space, best_id: str | None
) -> Any:
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
    labels = [
        f"{n}\n{'log ' if p.kind == 'loguniform' else ''}[{p.low:.3g}, {p.high:.3g}]"
        if p.kind != "choice"
        else f"{n}\n{list(p.choices)}"
        for p, n in zip(space.params, names, strict=True)
    ]
    ax.set_xticks(range(len(labels) + 1), [*labels, f"val loss\n[{lo:.4g}, {hi:.4g}]"])
    for x in range(len(labels) + 1):
        ax.axvline(x, color="k", lw=0.8)
    ax.set(
        ylabel="position in range (below 0: value 0)",
        title="Parallel coordinates (red = best; colour = loss, dashed = stopped early)",
    )
    return fig


def _normalize(p: Any, value: Any) -> float:
    if value is None:
        return math.nan
    if p.kind == "choice":
        return p.choices.index(value) / max(len(p.choices) - 1, 1) if value in p.choices else math.nan
    if p.kind == "loguniform":
        return (
            -0.1 if value <= 0 else (math.log(value) - math.log(p.low)) / (math.log(p.high) - math.log(p.low))
        )
    return (value - p.low) / (p.high - p.low)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
