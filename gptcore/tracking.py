"""TensorBoard event files for a run, written by rank 0 only (`tensorboard --logdir RUN`).

TensorBoard is an optional extra: without it this is a no-op, announced once.
"""

from __future__ import annotations

from pathlib import Path


class TensorBoardLog:
    def __init__(self, logdir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("note: install tensorboard (pip install 'gptrun[report]') for event files")
            self.writer = None
            return
        self.writer = SummaryWriter(log_dir=str(logdir))

    def log(self, metrics: dict[str, float]) -> None:
        if self.writer is None:
            return
        step = int(metrics.get("tokens", 0))  # tokens, so runs of any batch size line up
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
