"""The training loop: `Trainer.train_step` is one optimizer step, `Trainer.fit` the whole run.

The same loop runs in-process (`gptrun train --local`, see `gptcore.run`) and inside every Ray
Train worker (`experiments.train`), where the model is wrapped in DDP. The loop knows nothing of
Ray: it calls `on_report(metrics, state)` at every evaluation, and the caller decides where the
checkpoint state goes.

Determinism: every batch is a pure function of (seed, batch index, micro-step, rank), and the
checkpoint carries the batch index and all RNG states, so a resumed run repeats the uninterrupted
one exactly on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gptcore.config import ExperimentConfig, config_from_dict, run_budget
from gptcore.data import TokenData
from gptcore.errors import DivergedError, UserError
from gptcore.mfu import device_peak_flops, mfu
from gptcore.model import GPT
from gptcore.optim import AdamW, lr_at, param_groups

SHAPE_KEYS = ("style", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_positions",
              "vocab_size")
Report = Callable[[dict[str, float], dict[str, Any]], None]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"train.device={name!r} but CUDA is not available here; use cpu or auto")
    return torch.device(name)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; plain fp32 elsewhere (bf16 matmul on a CPU without bf16 units is
    ~100x slower than fp32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def open_data(cfg: ExperimentConfig) -> TokenData:
    """The prepared data of `cfg`, checked against the model it will feed."""
    data = TokenData(cfg.data.dir)
    if data.vocab_size != cfg.model.vocab_size:
        raise UserError(f"data folder {cfg.data.dir} has a {data.vocab_size}-token tokenizer but "
                        f"model.vocab_size={cfg.model.vocab_size}; set --set model.vocab_size="
                        f"{data.vocab_size} or re-prepare the data")
    return data


class Trainer:
    """One training run: model, optimizer, data, the step, evaluation, guards and state."""

    def __init__(self, cfg: ExperimentConfig, *, rank: int = 0, world_size: int = 1,
                 device: torch.device | None = None,
                 wrap: Callable[[nn.Module], nn.Module] | None = None,
                 log: Callable[[str], None] | None = print) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.log = log if rank == 0 and log is not None else (lambda _msg: None)
        self.device = device or resolve_device(cfg.train.device)
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        torch.manual_seed(cfg.train.seed)
        self.data = open_data(cfg)
        self.model = GPT(cfg.model).to(self.device)
        self.step_model = self.model  # what train_step calls: DDP and/or torch.compile wrap it
        if cfg.train.compile:
            self.step_model = torch.compile(self.step_model)
        if wrap is not None:
            self.step_model = wrap(self.step_model)
        self.optimizer = AdamW(param_groups(self.model, cfg.optim.weight_decay,
                                            cfg.optim.decay_embeddings),
                               lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                               eps=cfg.optim.eps)
        budget = run_budget(cfg, world_size)
        self.tokens_per_step, self.total_steps = budget.tokens_per_step, budget.total_steps
        self.flops_per_token = self.model.flops_per_token(cfg.model.seq_len)
        self.peak_flops, self.peak_source = device_peak_flops(self.device)
        # Progress and guard state: all of it goes into the checkpoint.
        self.step = 0  # optimizer steps taken
        self.batch_index = 0  # batches consumed, including skipped ones: the data position
        self.tokens_seen = 0
        self.lr_scale = 1.0  # halved by every rollback
        self.bad_streak = 0
        self.bad_steps = 0
        self.rollbacks = 0
        self.best_val_loss = math.inf
        self.resumed_from = 0  # the step this process started at (0 for a fresh run)
        self._snapshot: dict[str, Any] | None = None  # last checkpoint, for rollbacks

    # ---------------------------------------------------------------- the training step
    def train_step(self) -> dict[str, float]:
        """One optimizer step over `grad_accum` micro-batches. A non-finite loss or gradient
        skips the batch (no update) and counts towards the rollback guard."""
        t, o = self.cfg.train, self.cfg.optim
        lr = lr_at(self.step, self.total_steps, o) * self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.step_model.train()
        loss_sum = torch.zeros((), device=self.device)
        data_seconds = 0.0
        for micro in range(t.grad_accum):
            start = time.perf_counter()
            x, y = self.data.train_batch(seed=t.seed, step=self.batch_index, micro=micro,
                                         rank=self.rank, world_size=self.world_size,
                                         batch_size=t.batch_size, grad_accum=t.grad_accum,
                                         seq_len=self.cfg.model.seq_len)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            data_seconds += time.perf_counter() - start
            # DDP all-reduces gradients on the last micro-step only.
            last = micro == t.grad_accum - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.step_model, "no_sync") \
                else self.step_model.no_sync()
            with sync, autocast(self.device):
                _, loss = self.step_model(x, y)
                (loss / t.grad_accum).backward()
            loss_sum += loss.detach()
        self.batch_index += 1
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = o.grad_clip if o.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        loss = loss_sum / t.grad_accum
        if self.world_size > 1:  # every rank must agree whether to skip
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        loss_value, norm_value = loss.item(), grad_norm.item()
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self.optimizer.zero_grad(set_to_none=True)
            self._on_bad_step(loss_value)
            return {"loss": loss_value, "grad_norm": norm_value, "lr": lr, "skipped": 1.0,
                    "data_seconds": data_seconds}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_streak = 0
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return {"loss": loss_value, "grad_norm": norm_value, "lr": lr, "skipped": 0.0,
                "data_seconds": data_seconds}

    def _on_bad_step(self, loss_value: float) -> None:
        """The recipe's guard: skip, then roll back and halve the lr, then give up."""
        self.bad_steps += 1
        self.bad_streak += 1
        self.log(f"warning: non-finite loss ({loss_value}) at step {self.step}; batch skipped "
                 f"({self.bad_streak} in a row)")
        if self.bad_streak < self.cfg.train.max_bad_steps:
            return
        if self.rollbacks >= self.cfg.train.max_rollbacks:
            raise DivergedError(f"loss was non-finite for {self.bad_streak} steps in a row after "
                                f"{self.rollbacks} rollbacks (lr scale {self.lr_scale:g}); "
                                "lower optim.lr or raise optim.warmup")
        if self._snapshot is not None:
            keep = (self.batch_index, self.rollbacks, self.bad_steps, self.resumed_from)
            self.load_state_dict(self._snapshot)  # data moves on: the bad batches stay skipped
            self.batch_index, self.rollbacks, self.bad_steps, self.resumed_from = keep
        self.rollbacks += 1
        self.lr_scale *= 0.5
        self.bad_streak = 0
        self.log(f"warning: rolled back to step {self.step} with lr scale {self.lr_scale:g} "
                 f"(rollback {self.rollbacks}/{self.cfg.train.max_rollbacks})")

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the fixed validation slice (split across ranks, then all-reduced)."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for x, y in self.data.val_batches(seq_len=self.cfg.model.seq_len,
                                          batch_size=self.cfg.train.batch_size,
                                          eval_tokens=self.cfg.train.eval_tokens,
                                          rank=self.rank, world_size=self.world_size):
            x, y = x.to(self.device), y.to(self.device)
            with autocast(self.device):
                _, loss = self.model(x, y)
            totals[0] += loss.double() * y.numel()
            totals[1] += y.numel()
        if self.world_size > 1:
            dist.all_reduce(totals)
        val_loss = (totals[0] / totals[1].clamp(min=1)).item()
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)),
                "val_bpb": val_loss / math.log(2) / self.data.bytes_per_token("val")}

    # ---------------------------------------------------------------- the run
    def fit(self, on_report: Report | None = None, stop_at_step: int | None = None) -> dict:
        """Train to the budget. At every eval: evaluate, maybe checkpoint, call `on_report`.

        `stop_at_step` ends early (after that step's report), for tests and interruptions.
        Returns the last metrics, with `status` "completed"."""
        t = self.cfg.train
        end = self.total_steps if stop_at_step is None else min(stop_at_step, self.total_steps)
        if self.step == 0:
            self.log(f"model: {self.model.num_params() / 1e6:.2f}M parameters, "
                     f"{self.flops_per_token / 1e6:.1f} MFLOP/token | {self.total_steps} steps x "
                     f"{self.tokens_per_step} tokens | device {self.device} "
                     f"(peak {self.peak_source})")
        metrics: dict[str, float] = {}
        reported_step = -1
        window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
        while self.step < end:
            step_metrics = self.train_step()
            window_steps += 1
            window_data += step_metrics["data_seconds"]
            reporting = self.step % t.eval_interval == 0 or self.step == self.total_steps
            if self.step % t.log_interval == 0 or reporting:
                elapsed = time.perf_counter() - window_start
                metrics = self._throughput(step_metrics, elapsed, window_steps, window_data)
                self._log_progress(metrics)
                window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
            if reporting and not step_metrics["skipped"]:
                metrics = self._report(metrics, on_report)
                reported_step = self.step
                window_start = time.perf_counter()  # eval time is not training time
        if reported_step != self.step:  # stopped between evals: report and checkpoint here
            base = {"step": float(self.step), "tokens": float(self.tokens_seen)}
            metrics = self._report({**metrics, **base}, on_report, checkpoint=True)
        return {**metrics, "status": "completed"}

    def _throughput(self, step_metrics: dict[str, float], elapsed: float, steps: int,
                    data_seconds: float) -> dict[str, float]:
        tokens_per_sec = self.tokens_per_step * steps / max(elapsed, 1e-9)
        per_device = tokens_per_sec / self.world_size
        if data_seconds > 0.1 * elapsed:
            self.log(f"warning: data loading took {100 * data_seconds / elapsed:.0f}% of step "
                     "time; the loader is a bottleneck")
        return {"step": float(self.step), "tokens": float(self.tokens_seen),
                "loss": step_metrics["loss"], "lr": step_metrics["lr"],
                "grad_norm": step_metrics["grad_norm"], "tokens_per_sec": tokens_per_sec,
                "mfu": mfu(per_device, self.flops_per_token, self.peak_flops),
                "eta_sec": (self.total_steps - self.step) * elapsed / max(steps, 1),
                "bad_steps": float(self.bad_steps), "rollbacks": float(self.rollbacks)}

    def _log_progress(self, m: dict[str, float]) -> None:
        mfu_text = f"{100 * m['mfu']:.1f}%" if self.peak_flops else "n/a"
        self.log(f"step {self.step:>6}/{self.total_steps} | loss {m['loss']:.4f} | "
                 f"lr {m['lr']:.2e} | grad norm {m['grad_norm']:.3f} | "
                 f"{m['tokens_per_sec'] / 1e3:.1f}k tok/s | MFU {mfu_text} | "
                 f"ETA {_format_seconds(m['eta_sec'])}")

    def _report(self, metrics: dict[str, float], on_report: Report | None,
                checkpoint: bool = False) -> dict[str, float]:
        evaluation = self.evaluate()
        self.best_val_loss = min(self.best_val_loss, evaluation["val_loss"])
        metrics = {**metrics, **evaluation, "best_val_loss": self.best_val_loss,
                   "resumed_from": float(self.resumed_from)}
        self.log(f"eval step {self.step} | val loss {evaluation['val_loss']:.4f} | "
                 f"ppl {evaluation['val_ppl']:.2f} | bpb {evaluation['val_bpb']:.4f}")
        t = self.cfg.train
        every = t.checkpoint_interval or t.eval_interval
        state = None
        if checkpoint or self.step % every == 0 or self.step == self.total_steps:
            state = self.state_dict(metrics)
            self._snapshot = state
        if on_report is not None:
            on_report(metrics, state)
        return metrics

    # ---------------------------------------------------------------- state
    def state_dict(self, metrics: dict[str, float] | None = None) -> dict[str, Any]:
        """Everything a resume needs, as CPU tensors and plain values (weights_only-loadable)."""
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return copy.deepcopy({
            "model": {k: v.detach().float().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "step": self.step, "batch_index": self.batch_index, "tokens_seen": self.tokens_seen,
            "lr_scale": self.lr_scale, "bad_steps": self.bad_steps, "rollbacks": self.rollbacks,
            "best_val_loss": self.best_val_loss, "rng": rng,
            "config": self.cfg.to_dict(), "tokenizer_sha256": self.data.tokenizer_sha256,
            "metrics": dict(metrics or {}), "world_size": self.world_size,
        })

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint; refuses one from another model shape or tokenizer."""
        saved = config_from_dict(state["config"]).model
        diff = [f"{k}: {getattr(saved, k)} vs {getattr(self.cfg.model, k)}" for k in SHAPE_KEYS
                if getattr(saved, k) != getattr(self.cfg.model, k)]
        if diff:
            raise UserError(f"checkpoint is from another model shape ({'; '.join(diff)}); "
                            "use a new train.out folder or the checkpoint's config")
        if state["tokenizer_sha256"] != self.data.tokenizer_sha256:
            raise UserError(f"checkpoint was trained with another tokenizer than the one in "
                            f"{self.cfg.data.dir}; point data.dir at the original data folder")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for key in ("step", "batch_index", "tokens_seen", "lr_scale", "bad_steps", "rollbacks",
                    "best_val_loss"):
            setattr(self, key, state[key])
        self.resumed_from = self.step
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self._snapshot = state


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def _format_seconds(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
