"""The terminal table every command prints (sweep results, the noise check, the report): one
layout, so that widths, alignment and spacing cannot drift apart between copies."""

from __future__ import annotations

from collections.abc import Sequence


def print_columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print `header` then `rows`, each column right-aligned to its widest cell, two spaces apart.
    Cells are already formatted strings: the caller decides how a number reads."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    for line in (header, *rows):
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))
