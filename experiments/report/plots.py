"""The report's PNG plots, for pasting into a paper or a chat, drawn with matplotlib on the Agg
canvas (no display, no pyplot state): loss curves, loss against each hyperparameter at the
common token count, importances with their intervals, and the seed re-runs. Unfinished trials are
drawn too: a report of a running sweep shows where it is. report.html has the same plots,
interactive (`interactive`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments.report.common import CommonTokens, completed, evaluations, finite, param_name
from experiments.report.importance import LEVEL, Importances
from experiments.report.tables import write
from experiments.results import short_params
from experiments.space import Param, Space
from experiments.table import fmt_tokens
from gptcore.errors import UserError

LINE = {
    "completed": dict(ls="-", alpha=0.9),
    "stopped early": dict(color="grey", ls="--", alpha=0.6),
    "cut by budget": dict(color="tab:purple", ls="-.", alpha=0.6),
    "unfinished": dict(color="tab:orange", ls=":", lw=2),
    "diverged": dict(color="k", ls=":"),
    "refused": dict(color="k", ls=":"),
    "error": dict(color="k", ls=":"),
}
MARKER = {"completed": "o", "stopped early": "v", "cut by budget": "s", "unfinished": "X"}
FINAL = "#d62728"  # tab:red: the completed trials' final losses, in every plot


def figure_factory() -> Any:
    """A function making (figure, axes) on the Agg canvas (`ncols` > 1: a row of axes, sharing
    y unless told not to). Called before anything is written, so that a missing matplotlib is
    one UserError and no half report."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "gptrun report draws its plots with matplotlib, which is not installed; "
            "run: pip install 'gptrun[report]'"
        ) from None

    def make(width: float = 8.0, height: float = 5.0, ncols: int = 1, sharey: bool = True) -> tuple[Any, Any]:
        fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        axes = list(fig.subplots(1, ncols, sharey=sharey, squeeze=False)[0])
        return fig, axes[0] if ncols == 1 else axes

    return make


def draw_sweep(
    figure: Any,
    trials: list[dict[str, Any]],
    curves: list[dict[str, Any]],
    common: CommonTokens,
    space: Space,
    best_id: str | None,
    out_dir: Path,
) -> None:
    """curves.png, and params.png once a trial can be compared, into `out_dir`."""
    _save(_plot_curves(figure(), trials, curves, common, best_id), out_dir / "curves.png")
    (out_dir / "params.png").unlink(missing_ok=True)  # never leave a stale one behind
    if common.losses:
        _save(_plot_params(figure, trials, common, space, best_id), out_dir / "params.png")


def draw_importance(figure: Any, importances: Importances, common: CommonTokens, out_dir: Path) -> None:
    """importance.png: each parameter's importance and its bootstrap interval; none when the
    importances were not ranked (too few trials: the page says why)."""
    (out_dir / "importance.png").unlink(missing_ok=True)  # never leave a stale one behind
    if not importances.point:
        return
    names = list(importances.point)[::-1]  # the most important on top
    point = [importances.point[k] for k in names]
    fig, ax = figure(8.0, 1.5 + 0.6 * len(names))
    ax.errorbar(
        point,
        names,
        xerr=[
            [p - importances.low[k] for p, k in zip(point, names, strict=True)],
            [importances.high[k] - p for p, k in zip(point, names, strict=True)],
        ],
        fmt="o",
        capsize=6,
        color="tab:blue",
    )
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3, axis="x")
    ax.set(
        xlabel=f"importance (PED-ANOVA); bars: {LEVEL:.0%} bootstrap interval",
        title=f"Hyperparameter importance: {common.title}",
    )
    _save(fig, out_dir / "importance.png")


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
        if finite(row["std"]):
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


def zero_x(p: Param) -> float:
    """Where a log-scale parameter's chosen 0 (`include_zero`) is drawn: left of its range."""
    return p.low / 3


def x_value(p: Param, value: Any) -> Any:
    """A trial's value of `p` on the plot's x axis (a log-scale 0 at `zero_x`)."""
    return zero_x(p) if p.kind == "loguniform" and value == 0 else value


def param_panels(
    trials: list[dict[str, Any]], common: CommonTokens, space: Space
) -> Iterator[tuple[Param, str, dict[str, Any], dict[str, list[dict[str, Any]]]]]:
    """For each searched key, one panel of the loss-vs-hyperparameter plot: the key, its name,
    each trial's x, and the trials compared at the common token count by status."""
    for p in space.params:
        name = param_name(p.key)
        x = {t["trial_id"]: x_value(p, short_params(t["config"]).get(name)) for t in trials}
        groups = {
            s: [t for t in trials if t["status"] == s and t["trial_id"] in common.losses] for s in MARKER
        }
        yield p, name, x, {s: group for s, group in groups.items() if group}


def _save(fig: Any, path: Path) -> None:
    write(path, lambda tmp: fig.savefig(tmp, format="png"))


def _token_axis(axis: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda x, _: fmt_tokens(x)))


def _plot_curves(
    fa: tuple[Any, Any],
    trials: list[dict[str, Any]],
    curves: list[dict[str, Any]],
    common: CommonTokens,
    best_id: str | None,
) -> Any:
    fig, ax = fa
    labelled: set[str] = set()
    points_of = evaluations(curves)
    for i, t in enumerate(trials):
        pts = points_of.get(t["trial_id"], [])
        if not pts:
            continue
        if t["trial_id"] == best_id:
            style = dict(color=FINAL, lw=3, zorder=3, label=f"best {best_id}")
        else:
            style = {"color": f"C{i % 10}", "lw": 1.3, **LINE[t["status"]]}
        if "label" not in style and t["status"] not in labelled:
            labelled.add(t["status"])
            style["label"] = t["status"]
        ax.plot(*zip(*pts, strict=True), **style)
        if t["status"] == "unfinished":
            ax.plot(*pts[-1], marker="X", color="tab:orange", ms=9)
    if common.losses:
        ax.axvline(
            common.tokens, color="k", ls=":", lw=1, label=f"common token count ({fmt_tokens(common.tokens)})"
        )
    _token_axis(ax.xaxis)
    ax.set(xlabel="tokens", ylabel="validation loss", title="Validation loss per trial")
    ax.grid(alpha=0.3)
    if labelled or best_id:
        ax.legend(fontsize="small")
    return fig


def _plot_params(
    figure: Any, trials: list[dict[str, Any]], common: CommonTokens, space: Space, best_id: str | None
) -> Any:
    """One panel per searched key: every compared trial's loss at the common token count (blue,
    marker = status) and, as its own series, each completed trial's final loss (red star, joined
    to its own point at the budget: the gap is training, not the hyperparameter)."""
    fig, axes = figure(max(8.0, 4.0 * len(space.params)), 4.5, ncols=len(space.params))
    axes = [axes] if len(space.params) == 1 else axes
    done, final_at = completed(trials)
    for ax, (p, name, x, groups) in zip(axes, param_panels(trials, common, space), strict=True):
        for status, group in groups.items():
            ax.scatter(
                [x[t["trial_id"]] for t in group],
                [common.losses[t["trial_id"]] for t in group],
                marker=MARKER[status],
                s=60,
                color="tab:blue",
                edgecolors="k",
                zorder=2,
                label=f"{status}: at {fmt_tokens(common.tokens)}",
            )
        for t in done:
            tid = t["trial_id"]
            if tid in common.losses:
                ax.plot([x[tid]] * 2, [common.losses[tid], t["val_loss"]], color=FINAL, lw=0.8, ls=":")
        if done:
            ax.scatter(
                [x[t["trial_id"]] for t in done],
                [t["val_loss"] for t in done],
                marker="*",
                s=160,
                color=FINAL,
                edgecolors="k",
                zorder=3,
                label=f"completed: final, at {final_at}",
            )
        best = next((t for t in trials if t["trial_id"] == best_id), None)
        if best is not None:
            ax.scatter(
                [x[best_id]],
                [best["val_loss"]],
                s=380,
                facecolors="none",
                edgecolors="k",
                lw=1.5,
                zorder=4,
                label=f"best {best_id} (final)",
            )
        xlabel = name
        if p.kind == "loguniform":
            ax.set_xscale("log")
            if any(v == zero_x(p) for v in x.values()):
                ax.axvline(p.low / 1.7, color="grey", lw=0.8, ls="--")
                xlabel += f" (left of the dashed line: {name} = 0)"
        ax.set(xlabel=xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss")
    if common.losses:
        axes[0].legend(fontsize="small")
    fig.suptitle(
        f"{common.title[:1].upper()}{common.title[1:]} (blue)"
        + (f"; completed trials' final loss at {final_at} tokens (red)" if done else "")
    )
    return fig
