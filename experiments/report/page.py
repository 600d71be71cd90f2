"""report.html: one static page (no server, no script, opens from disk) with the trial table, the
plots beside it, the importances and the noise section. Every value from a file is escaped."""

from __future__ import annotations

import math
from collections import Counter
from html import escape
from pathlib import Path
from typing import Any

from experiments.config import RayExperiment
from experiments.confirm import noise_line, verdict
from experiments.report.plots import PLOTS
from experiments.space import Space, config_value


def html_page(
    exp_dir: Path,
    trials: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    best: dict[str, Any] | None,
    importance_note: str | None,
    noise: str,
) -> str:
    """The whole page. `rows` are the trials.parquet rows (node ids cut to 8 characters here);
    `importance_note` says why there is no importance plot; `noise` is the noise section's HTML."""
    counts = ", ".join(f"{n} {s}" for s, n in Counter(t["status"] for t in trials).items())
    head = "".join(f"<th>{escape(k)}</th>" for k in (rows[0] if rows else ()))
    body = "".join(
        f"<tr class='{r['status'].replace(' ', '-')}'>"
        + "".join(f"<td>{escape(_cell(v[:8] if k == 'node_id' else v))}</td>" for k, v in r.items())
        + "</tr>"
        for r in rows
    )
    best_line = (
        f"Best trial <b>{escape(best['trial_id'])}</b>: val loss {best['val_loss']:.4f} "
        f"({escape(best['status'])}); config <a href='best.toml'>best.toml</a>; checkpoint "
        f"<code>{escape(best['checkpoint'] or '-')}</code>"
        if best
        else "No trial has finished without error yet, so there is no best config."
    )
    plots = "".join(f"<h2>{title}</h2><img src='{name}' alt='{title}'>" for name, title in PLOTS)
    imp = (
        f"<p>{escape(importance_note)}</p>"
        if importance_note
        else "<img src='importance.png' alt='hyperparameter importance'>"
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>gptrun sweep {escape(exp_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}} table{{border-collapse:collapse;
font-size:13px}} td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}
tr.unfinished{{background:#ffe9c7;font-style:italic}} tr.stopped-early,tr.cut-by-budget{{color:#666}}
tr.diverged,tr.error{{color:#a00}} img{{max-width:100%}}</style></head><body>
<h1>Sweep {escape(exp_dir.name)}</h1>
<p>{len(trials)} trials: {escape(counts or "none yet")}. Unfinished trials are highlighted.</p>
<p class="best">{best_line}</p>
<h2>Trials</h2><table><tr>{head}</tr>{body}</table>
{plots}<h2>Hyperparameter importance</h2>{imp}
<h2>Noise</h2>{noise}
</body></html>
"""


def noise_html(noise: dict[str, Any] | None, exp_dir: Path) -> str:
    """The noise section: the verdict, the noise line and the re-runs (beside noise.png), or how
    to measure the noise when `gptrun confirm` has not."""
    if noise is None:
        return (
            "<p>Seed-to-seed noise has not been measured for this sweep, so differences between "
            "close trials may be noise; to measure it, re-run the best configs with new seeds "
            f"(<code>gptrun confirm {escape(str(exp_dir))} --top 3 --seeds 3</code>).</p>"
        )
    line = noise_line(noise)
    rows = "".join(
        f"<tr><td>{escape(r['trial_id'])}</td><td>{_cell(r['sweep_val_loss'])}</td>"
        f"<td>{_cell(r['mean'])}</td><td>{_cell(r['std'])}</td>"
        f"<td>{len(r['losses'])}</td></tr>"
        for r in noise["candidates"]
    )
    return (
        f"<p>{escape(verdict(noise))}. {escape(line[:1].upper() + line[1:])}.</p>"
        "<table><tr><th>trial</th><th>sweep loss</th><th>mean</th><th>std</th><th>runs</th>"
        f"</tr>{rows}</table><img src='noise.png' alt='noise'>"
    )


def baseline_note(cfg: RayExperiment, space: Space, trials: list[dict[str, Any]]) -> str:
    """How many trials ran the base config's own values: the one to beat."""
    base = {p.key: config_value(cfg, p.key) for p in space.params}
    same = sum(all(_same(space.overrides(t["config"]).get(k), v) for k, v in base.items()) for t in trials)
    values = ", ".join(
        f"{k.rpartition('.')[2]}={v:g}" if isinstance(v, float) else f"{k.rpartition('.')[2]}={v}"
        for k, v in base.items()
    )
    return f"<p>{same} trial(s) ran with the baseline config ({values}).</p>"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b
