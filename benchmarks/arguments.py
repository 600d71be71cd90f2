"""Command-line arguments that several benchmarks take."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def comma_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a non-empty comma list of `choices` ("fp32,bf16")."""

    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of {', '.join(choices)}")
        return items

    return parse
