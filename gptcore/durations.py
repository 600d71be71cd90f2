"""How a duration reads in gptrun's lines (a run's ETA, `gptrun plan`'s wall-clock, compile
decisions): one scale for all, so that the same seconds never read two ways."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """0.4 s, 28 s, 6.0 min, 1.5 h: the scale a person reads a wait at."""
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
