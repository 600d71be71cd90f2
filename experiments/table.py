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


def fmt_tokens(tokens: float) -> str:
    """A token count as people say it, to 3 significant digits: 512, 76.8k, 102k, 1.23M, 2.5G."""
    rounded = float(f"{tokens:.3g}")  # first, so that 999,950 reads 1M and not 1e+03k
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(rounded) >= scale:
            return f"{rounded / scale:.3g}{suffix}"
    return f"{rounded:.3g}"


def fmt_sci(value: float) -> str:
    """A value spread over decades (lr, weight decay, eps) in scientific notation to 3
    significant digits, without trailing zeros: 1.75e-3, 2e-3. Zero stays 0."""
    if value == 0:
        return "0"
    mantissa, _, exponent = f"{value:.2e}".partition("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
