"""`gptrun train --local`: one run in this process, checkpoints in `train.out/checkpoints/`.

Rerunning the same command resumes from `last.pt` (or, for a run that is complete, says so and
stops); Ctrl-C writes a checkpoint (of the last
completed step) before it exits.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from gptcore.atomic import atomic_file, check_writable_dir, write_text_atomic
from gptcore.checkpoint import load_checkpoint, save_checkpoint
from gptcore.config import ExperimentConfig
from gptcore.tracking import TensorBoardLog
from gptcore.train import Trainer


class LocalRun:
    """Persists what a `Trainer` reports: metrics.jsonl, last.pt and best.pt under `out`."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.checkpoints = self.out / "checkpoints"
        self.best_val = math.inf
        self.tensorboard = TensorBoardLog(self.out / "tensorboard")

    def on_report(self, metrics: dict[str, float], state: dict[str, Any] | None) -> None:
        self.tensorboard.log(metrics)
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        if state is None:
            return
        last = save_checkpoint(self.checkpoints / "last.pt", state)
        if metrics["val_loss"] < self.best_val:
            self.best_val = metrics["val_loss"]
            with atomic_file(self.checkpoints / "best.pt") as tmp:
                shutil.copyfile(last, tmp)


def train_local(cfg: ExperimentConfig) -> dict[str, float]:
    """Train `cfg` in this process. Everything that can refuse the run (the output folder, the
    data, the device, a checkpoint to resume) is checked before anything is written."""
    out = Path(cfg.train.out)
    check_writable_dir(out, "train.out (--out)")
    trainer = Trainer(cfg)
    last = out / "checkpoints" / "last.pt"
    if last.exists():
        state = load_checkpoint(last)
        trainer.load_state_dict(state)
        if trainer.step >= trainer.total_steps:  # nothing to train: no compile, no new checkpoint
            val = state["metrics"].get("val_loss")
            print(
                f"{out} is a complete run (step {trainer.step}/{trainer.total_steps}"
                + (f", val loss {val:.4f}" if val is not None else "")
                + f"): nothing to do; checkpoint {last}. To train longer, raise train.max_steps "
                "or train.max_tokens with train.extend=true; for a new run, give another train.out"
            )
            return {**state["metrics"], "status": "completed"}
        print(f"resumed from {last} at step {trainer.step}/{trainer.total_steps}")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "config.toml", cfg.to_toml())
    run = LocalRun(out)
    run.best_val = trainer.best_val_loss
    try:
        result = trainer.fit(run.on_report)
    except KeyboardInterrupt:  # fit lets Ctrl-C through between steps (after their evaluations) only
        save_checkpoint(last, trainer.state_dict())
        print(
            f"\ninterrupted at step {trainer.step}; checkpoint saved to {last}; "
            "run the same command to resume"
        )
        raise
    finally:
        run.tensorboard.close()
    print(
        f"done: step {trainer.step}, val loss {result['val_loss']:.4f}, "
        f"bpb {result['val_bpb']:.4f} | best checkpoint {run.checkpoints / 'best.pt'} | "
        f"last checkpoint {last}"
    )
    return result
