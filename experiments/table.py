"""The terminal table every command prints (sweep results, the noise check, the report): one
layout, so that widths, alignment and spacing cannot drift apart between copies."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence


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


def short_ids(ids: Iterable[str]) -> dict[str, str]:
    """Each Ray node id as the tables show it: its first 8 hex digits, or its last 8 where the
    first 8 of two nodes are the same (Ray's fake multi-node provider numbers its nodes at the
    end of a run of f's, so that only the end tells them apart)."""
    distinct = {i for i in ids if i}
    heads = Counter(i[:8] for i in distinct)
    return {i: i[:8] if heads[i[:8]] == 1 else i[-8:] for i in distinct}
