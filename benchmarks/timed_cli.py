"""Run one gptrun command in its own process and time it: the real command, start-up and all."""

from __future__ import annotations

import subprocess
import sys
import time


def timed_gptrun(args: list[str], env: dict[str, str], what: str) -> tuple[float, str]:
    """(wall-clock seconds, stdout + stderr) of `gptrun ARGS`; a failure ends the benchmark with
    the end of its output, naming `what` failed."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "experiments.cli", *args], env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{log[-3000:]}")
    return seconds, log
