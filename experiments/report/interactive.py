"""report.html's interactive plots (plotly: hover, zoom, pan, click a legend entry to hide a
series), each as a `<div>` for a page that embeds plotly.js once (`plotly_js`), so that it opens
offline from disk.

Optuna draws what it draws well from the trials at the common token count (`common.analysis_study`):
the lr x weight decay contour and the parallel coordinates. The curves and the loss against
each hyperparameter are drawn here: they show what Optuna's plots cannot, each trial's values
on hover and the completed trials' final losses as their own series beside the common token count."""

from __future__ import annotations

from typing import Any

from experiments.report.common import CommonTokens, completed, evaluations, param_name
from experiments.report.importance import LEVEL, Importances
from experiments.report.plots import FINAL, MARKER, param_panels, zero_x
from experiments.results import short_params
from experiments.space import Space
from experiments.table import fmt_sci, fmt_tokens
from gptcore.errors import UserError

DASH = {"completed": "solid", "stopped early": "dash", "cut by budget": "dashdot", "unfinished": "dot"}
SYMBOL = {"o": "circle", "v": "triangle-down", "s": "square", "X": "x"}  # matplotlib's -> plotly's
TOKENS_AXIS = dict(title="tokens", tickformat=".3~s")  # 102k, 1.23M: as the tables write them


def check_plotly() -> None:
    """A missing plotly is one UserError, before anything is written."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise UserError(
            "gptrun report draws report.html's plots with plotly, which is not installed; "
            "run: pip install 'gptrun[report]'"
        ) from None


def plotly_js() -> str:
    """plotly.js itself (~5 MB), for one inline <script> per page: no CDN, opens offline."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def div(fig: Any, div_id: str) -> str:
    """One figure as a <div> and the script that draws it (plotly.js must be on the page)."""
    fig.update_layout(template="plotly_white", margin=dict(t=60, b=50))
    return fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        div_id=div_id,
        default_height="480px",
        config={"displaylogo": False},
    )


def trial_hover(t: dict[str, Any], space: Space) -> str:
    """What hovering a trial shows: its id, status and searched values (log-scale ones in
    scientific notation)."""
    values = short_params(t["config"])
    shown = []
    for p in space.params:
        name = param_name(p.key)
        value = values.get(name)
        if isinstance(value, float):
            value = fmt_sci(value) if p.kind == "loguniform" else f"{value:.3g}"
        shown.append(f"{name} {value}")
    return f"<b>{t['trial_id']}</b> ({t['status']})<br>{' · '.join(shown)}"


def curves_figure(
    trials: list[dict[str, Any]],
    curves: list[dict[str, Any]],
    common: CommonTokens,
    space: Space,
    best_id: str | None,
) -> Any:
    """Val loss vs tokens, one line per trial (dash = status), the common token count marked."""
    import plotly.graph_objects as go

    fig = go.Figure()
    points_of = evaluations(curves)
    for t in trials:
        pts = points_of.get(t["trial_id"], [])
        if not pts:
            continue
        best = t["trial_id"] == best_id
        fig.add_trace(
            go.Scatter(
                x=[p[0] for p in pts],
                y=[p[1] for p in pts],
                mode="lines+markers",
                name=f"{t['trial_id']} ({'best, ' if best else ''}{t['status']})",
                line=dict(
                    dash=DASH.get(t["status"], "dot"),
                    width=4 if best else 2,
                    **({"color": FINAL} if best else {}),
                ),
                hovertemplate=f"{trial_hover(t, space)}<br>%{{x:.3~s}} tokens: val loss %{{y:.4f}}"
                "<extra></extra>",
            )
        )
    if common.losses:
        fig.add_vline(
            x=common.tokens,
            line_dash="dot",
            annotation_text=f"common token count: {fmt_tokens(common.tokens)} tokens",
        )
    fig.update_layout(
        title=f"Validation loss vs tokens ({len(fig.data)} trials; dashed: stopped early)",
        xaxis=TOKENS_AXIS,
        yaxis_title="validation loss",
    )
    return fig


def params_figure(trials: list[dict[str, Any]], common: CommonTokens, space: Space) -> Any:
    """Loss at the common token count against each searched key (one panel each; log-scale keys on a
    log axis, a chosen 0 left of the range), and each completed trial's final loss as its own
    series, joined to its own point at the budget."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(space.params), shared_yaxes=True)
    done, final_at = completed(trials)
    for col, (p, name, x, groups) in enumerate(param_panels(trials, common, space), 1):
        for status, group in groups.items():
            fig.add_trace(
                go.Scatter(
                    x=[x[t["trial_id"]] for t in group],
                    y=[common.losses[t["trial_id"]] for t in group],
                    mode="markers",
                    marker=dict(symbol=SYMBOL[MARKER[status]], size=10, color="#1f77b4", line=dict(width=1)),
                    name=f"{status}: at {fmt_tokens(common.tokens)}",
                    legendgroup=status,
                    showlegend=col == 1,
                    hovertext=[trial_hover(t, space) for t in group],
                    hovertemplate=f"%{{hovertext}}<br>{common.label}: %{{y:.4f}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        if done:
            joined_x: list[Any] = []
            joined_y: list[Any] = []
            for t in done:
                if t["trial_id"] in common.losses:
                    joined_x += [x[t["trial_id"]], x[t["trial_id"]], None]
                    joined_y += [common.losses[t["trial_id"]], t["val_loss"], None]
            fig.add_trace(
                go.Scatter(
                    x=joined_x,
                    y=joined_y,
                    mode="lines",
                    line=dict(color=FINAL, dash="dot", width=1),
                    hoverinfo="skip",
                    showlegend=False,
                ),
                row=1,
                col=col,
            )
            fig.add_trace(
                go.Scatter(
                    x=[x[t["trial_id"]] for t in done],
                    y=[t["val_loss"] for t in done],
                    mode="markers",
                    marker=dict(symbol="star", size=14, color=FINAL, line=dict(width=1)),
                    name=f"completed: final, at {final_at}",
                    legendgroup="final",
                    showlegend=col == 1,
                    hovertext=[trial_hover(t, space) for t in done],
                    hovertemplate=f"%{{hovertext}}<br>final val loss at {final_at}: %{{y:.4f}}"
                    "<extra></extra>",
                ),
                row=1,
                col=col,
            )
        title = name
        if p.kind == "loguniform":
            fig.update_xaxes(type="log", exponentformat="e", row=1, col=col)
            if any(v == zero_x(p) for v in x.values()):
                title += f" (0 drawn at {fmt_sci(zero_x(p))})"
        fig.update_xaxes(title_text=title, row=1, col=col)
    fig.update_yaxes(title_text="validation loss", row=1, col=1)
    fig.update_layout(
        title=f"Loss vs each hyperparameter: {common.title}"
        + (f"; completed trials' final loss at {final_at} as its own series" if done else "")
    )
    return fig


def contour_figure(study: Any, space: Space, common: CommonTokens) -> Any | None:
    """Optuna's contour of the loss at the common token count over lr x weight decay (or the first
    two searched keys); None with fewer than two keys. Trials with weight decay 0 have no
    point on a log axis: the title counts them."""
    import optuna

    names = [param_name(p.key) for p in space.params]
    pair = ["lr", "weight_decay"] if {"lr", "weight_decay"} <= set(names) else names[:2]
    if len(pair) < 2:
        return None
    trials = study.get_trials(deepcopy=False)
    shown = sum(all(k in t.params for k in pair) for t in trials)
    fig = optuna.visualization.plot_contour(study, params=pair, target_name=common.label)
    missing = f"; {len(trials) - shown} with {' or '.join(pair)} = 0 not shown" if shown < len(trials) else ""
    fig.update_layout(title=f"{common.label}: {pair[0]} x {pair[1]} ({shown} trials{missing})")
    return fig


def parallel_figure(study: Any, common: CommonTokens) -> Any:
    """Optuna's parallel coordinates of the trials at the common token count. A chosen 0 of a
    log-scale key has no value on its axis (the trial lacks the key, and its `=0` axis says
    True): Optuna marks that place "None", which is relabelled 0, on the axis and in the hover."""
    import optuna

    fig = optuna.visualization.plot_parallel_coordinate(study, target_name=common.label)
    fig.update_layout(title=f"Parallel coordinates: {common.title}")
    for note in fig.layout.annotations:
        if note.text == "None":
            note.text = "0"
    for trace in fig.data:
        if trace.customdata is not None:
            trace.customdata = [[name, "0" if value == "None" else value] for name, value in trace.customdata]
    return fig


def importance_figure(importances: Importances, common: CommonTokens) -> Any:
    """Each parameter's PED-ANOVA importance (dot) and its bootstrap interval (bar)."""
    import plotly.graph_objects as go

    names = list(importances.point)[::-1]  # the most important on top
    point = [importances.point[k] for k in names]
    fig = go.Figure(
        go.Scatter(
            x=point,
            y=names,
            mode="markers",
            marker=dict(size=12),
            error_x=dict(
                type="data",
                array=[importances.high[k] - v for k, v in zip(names, point, strict=True)],
                arrayminus=[v - importances.low[k] for k, v in zip(names, point, strict=True)],
            ),
            customdata=[[importances.low[k], importances.high[k]] for k in names],
            hovertemplate="%{y}: %{x:.2f} (interval %{customdata[0]:.2f} to %{customdata[1]:.2f})"
            "<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"Hyperparameter importance (PED-ANOVA): {common.title}",
        xaxis=dict(title=f"importance; bars: {LEVEL:.0%} bootstrap interval", range=[0, 1]),
        height=200 + 50 * len(names),
    )
    return fig
