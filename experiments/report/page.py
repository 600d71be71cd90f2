"""report.html: one self-contained page (plotly.js inline, images as data: URIs: it opens
offline from disk, and can be mailed alone) with the trial table, the interactive plots, the
importances and the noise section. Every value from a file is escaped."""

from __future__ import annotations

import base64
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from experiments.noise import noise_line, verdict
from experiments.ray_config import RayExperiment
from experiments.record import WARM_FROM
from experiments.report import interactive
from experiments.report.common import CommonTokens
from experiments.report.importance import Importances
from experiments.results import short_params
from experiments.space import Space, config_value
from experiments.table import fmt_sci, fmt_tokens, short_ids
from experiments.warm_start import WARM_TRIAL

STATUS = {  # a status in words, and what it means on hover
    "completed": "trained its full token budget",
    "stopped early": "stopped by ASHA at a rung: worse than the trials it was compared with there",
    "cut by budget": "ended by the sweep's time budget before its token budget",
    "unfinished": "running, or interrupted and not yet resumed",
    "diverged": "its loss became NaN or infinite",
    "refused": "the config refused its sampled values: see the reason column",
    "error": "failed for a reason that says nothing of its hyperparameters: see the reason column",
}
HEADERS = {
    "rank": "#",
    "trial_id": "trial",
    "tokens": "tokens",
    "val_loss": "final val loss",
    "best_val_loss": "best val loss",
    "val_bpb": "bpb",
    "wall_s": "wall",
    "startup_s": "start-up",
    "winddown_s": "wind-down",
    "node_id": "node",
}
STYLE = """body{font-family:sans-serif;max-width:1200px;margin:auto;padding:0 1em}
table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;white-space:nowrap}
th.at,td.at{background:#eef4fb;font-weight:bold} tr.unfinished{background:#ffe9c7;font-style:italic}
tr.stopped-early,tr.cut-by-budget{color:#555} tr.diverged,tr.refused,tr.error{color:#a00}
img{max-width:100%} p.note{background:#f6f6f6;padding:.5em 1em;border-left:4px solid #888}
td.path{text-align:left} td.path div{max-width:16em;overflow:hidden;text-overflow:ellipsis}"""


# The page (page.html.jinja) and its parts (the macros of parts.html.jinja), rendered with
# autoescape: every value is escaped unless it is HTML made here (Markup: a macro's result, the
# plots' <div>s, plotly.js).
ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("experiments.report", "."), autoescape=True, undefined=jinja2.StrictUndefined
)
ENV.filters["tokens"] = fmt_tokens
PAGE = ENV.get_template("page.html.jinja")
PARTS = ENV.get_template("parts.html.jinja").module


def report_page(
    exp_dir: Path,
    out_dir: Path,
    cfg: RayExperiment,
    space: Space,
    trials: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    curves: list[dict[str, Any]],
    common: CommonTokens,
    study: Any,
    ranked: Importances,
    best: dict[str, Any] | None,
    noise: dict[str, Any] | None,
    warm_start: str = "",
) -> str:
    """report.html: the summary, the trial table (`rows`: trials.parquet's), the interactive
    plots (`study`: the trials at the common token count), the importances, the noise section, the
    warm-start history (`warm_start`: its HTML, "" for a cold sweep) and the PNGs."""
    drawable = len(common.losses) >= 2  # Optuna's contour and parallel coordinates need two trials
    contour = interactive.contour_figure(study, space, common) if drawable else None
    too_few = PARTS.too_few(len(common.losses))
    params = interactive.params_figure(trials, common, space) if common.losses else None
    sections = {
        "Summary": best_html(best) + common_note(common, trials) + baseline_note(cfg, space, trials),
        "Trials": trial_table(trials, rows, common, space, out_dir),
        "Validation loss vs tokens": interactive.div(
            interactive.curves_figure(trials, curves, common, space, best["trial_id"] if best else None),
            "curves",
        ),
        "Loss vs each hyperparameter": interactive.div(params, "params") if params else too_few,
        "Contour": (
            interactive.div(contour, "contour")
            if contour
            else too_few
            if not drawable
            else PARTS.needs_two_params()
        ),
        "Parallel coordinates": (
            interactive.div(interactive.parallel_figure(study, common), "parallel") if drawable else too_few
        ),
        "Hyperparameter importance": importance_html(ranked, common),
        "Noise": noise_html(noise, exp_dir, out_dir),
        **({"Warm start": warm_start} if warm_start else {}),
        "Images": png_images(out_dir),
    }
    return html_page(exp_dir.name, trials, sections, interactive.plotly_js())


def html_page(name: str, trials: list[dict[str, Any]], sections: dict[str, str], plotly_js: str) -> str:
    """The whole page: a summary line, then `sections` (heading -> HTML: a table, a plot's
    <div>, a note), in order; `plotly_js` is inlined once, in the head."""
    counts = ", ".join(f"{n} {s}" for s, n in Counter(t["status"] for t in trials).items())
    sections = {title: Markup(html) for title, html in sections.items()}
    return PAGE.render(
        name=name,
        trials=trials,
        counts=counts,
        style=Markup(STYLE),
        plotly_js=Markup(plotly_js),
        sections=sections,
    )


def best_html(best: dict[str, Any] | None) -> str:
    """The best trial's line: its final loss, best.toml, its checkpoint."""
    return PARTS.best_line(best)


def common_note(common: CommonTokens, trials: list[dict[str, Any]]) -> str:
    """What the comparisons compare, and which trials they leave out."""
    return PARTS.common_note(common, sum(t["status"] == "completed" for t in trials))


def trial_table(
    trials: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    common: CommonTokens,
    space: Space,
    out_dir: Path,
) -> str:
    """The trial table: final values, and the loss at the common token count beside them (bold)."""
    if not rows:
        return "<p>No trials yet.</p>"
    sci = {p.key.rpartition(".")[2] for p in space.params if p.kind == "loguniform"}
    paths = {t["trial_id"]: t.get("path", "") for t in trials}
    nodes = short_ids(r["node_id"] for r in rows)
    keys = [k for k in rows[0] if k != "common_tokens"]
    headers = [
        {"text": f"val loss at {fmt_tokens(common.tokens)}", "class": "at"}
        if k == "common_val_loss"
        else {"text": HEADERS.get(k, k)}
        for k in keys
    ]
    cells = [
        (
            r["status"].replace(" ", "-"),
            [_cell(k, r[k], sci, paths.get(r["trial_id"], ""), nodes, out_dir) for k in keys],
        )
        for r in rows
    ]
    return PARTS.trial_table(headers, cells)


def importance_html(ranked: Importances, common: CommonTokens) -> str:
    """The importances with their intervals, or why there are none; and what to keep in mind."""
    plot = (
        interactive.div(interactive.importance_figure(ranked, common), "importance") if ranked.point else ""
    )
    return PARTS.importance(Markup(plot), ranked.note)


def png_images(out_dir: Path) -> str:
    """The PNGs that were drawn, held in the page (it is mailed alone), and their file names
    beside it (for a paper or a chat). noise.png is in the noise section already."""
    names = [n for n in ("curves.png", "params.png", "importance.png") if (out_dir / n).exists()]
    return PARTS.images(names, [png(out_dir / n, n) for n in names])


def png(path: Path, alt: str) -> str:
    """An <img> holding the PNG itself (a data: URI), so that the page needs no other file."""
    return PARTS.png(base64.b64encode(path.read_bytes()).decode("ascii"), alt)


def _cell(key: str, value: Any, sci: set[str], path: str, nodes: dict[str, str], out: Path) -> dict[str, Any]:
    """A cell of the trial table: its text, and where it has them its class, hover title, link."""
    if key == "trial_id" and path and "://" not in path:
        return {"text": value, "href": Path(os.path.relpath(path, out)).as_posix() + "/"}
    if key == "status":
        return {"text": value, "title": STATUS.get(value, "")}
    if key == "common_val_loss":
        return {"text": _number(value, ".4f"), "class": "at"}
    if key == "tokens":
        return {"text": fmt_tokens(value)}
    if key in sci and isinstance(value, float):
        return {"text": fmt_sci(value)}
    if key in ("val_loss", "best_val_loss", "val_bpb"):
        return {"text": _number(value, ".4f")}
    if key.endswith("_s") and isinstance(value, float):
        return {"text": "-" if math.isnan(value) else f"{value:.3g}s"}
    if key in ("checkpoint", "reason") and value:  # cut to the column's width; all of it on hover
        # The width is the inner block's: CSS leaves max-width on a table cell undefined.
        shown = Path(value).name if key == "checkpoint" else value  # the trial is in its own column
        return {"text": shown, "title": value, "class": "path"}
    if key == "node_id":
        return {"text": nodes.get(value, "-"), "title": value}
    return {"text": _text(value)}


def _number(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, (int, float)) or math.isnan(value) else format(value, spec)


def warm_start_html(history: list[Any], line: str) -> str:
    """The warm-start section: the earlier sweep's trials that this sweep's TPE started from
    (optuna FrozenTrials), best first; "" for a sweep that was not warm-started."""
    if not line:
        return ""
    rows = [
        (
            t.user_attrs[WARM_FROM],
            t.user_attrs[WARM_TRIAL],
            "completed" if t.state.name == "COMPLETE" else "stopped early",
            _text(t.value),
            fmt_tokens(max(t.intermediate_values, default=0)),
            ", ".join(f"{k}={_text(v)}" for k, v in short_params(t.params).items()),
        )
        for t in sorted(history, key=lambda t: t.value)
    ]
    return PARTS.warm_start(line, rows)


def noise_html(noise: dict[str, Any] | None, exp_dir: Path, out_dir: Path) -> str:
    """The noise section: the verdict, the noise line and the re-runs (beside noise.png), or how
    to measure the noise when `gptrun confirm` has not."""
    if noise is None:
        return PARTS.no_noise(exp_dir)
    line = noise_line(noise)
    rows = [
        (r["trial_id"], _text(r["sweep_val_loss"]), _text(r["mean"]), _text(r["std"]), len(r["losses"]))
        for r in noise["candidates"]
    ]
    image = png(out_dir / "noise.png", "noise")
    return PARTS.noise(verdict(noise), line[:1].upper() + line[1:], rows, image)


def baseline_note(cfg: RayExperiment, space: Space, trials: list[dict[str, Any]]) -> str:
    """How many trials ran the base config's own values: the one to beat."""
    base = {p.key: config_value(cfg, p.key) for p in space.params}
    same = sum(all(_same(space.overrides(t["config"]).get(k), v) for k, v in base.items()) for t in trials)
    sci = {p.key for p in space.params if p.kind == "loguniform"}
    values = ", ".join(
        f"{k.rpartition('.')[2]}={fmt_sci(v) if k in sci else format(v, 'g')}"
        if isinstance(v, float)
        else f"{k.rpartition('.')[2]}={v}"
        for k, v in base.items()
    )
    return PARTS.baseline_note(same, values)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b
