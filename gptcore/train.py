"""The training loop: `Trainer.train_step` is one optimizer step, `Trainer.fit` the whole run.

The same loop runs in-process (`gptrun train --local`, see `gptcore.run`) and inside every Ray
Train worker (`experiments.ray_train`), where the model is wrapped in DDP. The loop knows nothing of
Ray: it calls `on_report(metrics, state)` at every evaluation, and the caller decides where the
checkpoint state goes.

Determinism: every batch is a pure function of (seed, batch index, micro-step, rank), and so are
the dropout masks (seeded per (seed, rank, batch index): different on every DDP rank), and the
checkpoint carries the batch index and all RNG states, so a resumed run repeats the uninterrupted
one exactly on CPU. Ctrl-C is held until the step in progress (and its evaluation, when one is
due) has finished, so an interrupt checkpoint is always taken between steps and after the
evaluations up to its step.

Host syncs: a step never reads a value back from the device (on a GPU the CPU queues the next
steps while one runs). The divergence guard skips a non-finite step by a device-side flag, and the
host reads the queued steps' outcomes once per log interval, at evaluations and at the end
(`fit`'s `catch_up`), where it counts, logs and rolls back exactly as if it had read every step.

Clocks: `step` counts optimizer steps and is the lr schedule's position, so a rollback sets it
back to the checkpoint's step. `tokens` (`tokens_seen`) counts the tokens of every applied step,
including steps that a rollback later undid: it never decreases, and it is the clock a scheduler
should use (ASHA's `time_attr`). After a rollback it exceeds step x tokens per step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from torch import nn

from gptcore import autocompile
from gptcore.chat_data import ChatData, open_prepared
from gptcore.checkpoint import load_checkpoint
from gptcore.config import SHAPE_KEYS, ExperimentConfig, model_world_config, run_length, run_length_line
from gptcore.data import IGNORE_INDEX, Prefetcher, TokenData
from gptcore.device import resolve_device, use_tf32
from gptcore.durations import duration
from gptcore.errors import DivergedError, UserError
from gptcore.lora import adapter_weights, add_lora, base_record, load_adapters, model_from_state
from gptcore.mfu import cpu_matmul_flops, device_peak_flops, mfu
from gptcore.model import GPT
from gptcore.optim import AdamW, lr_at, param_groups, scalar_dtype, set_lr
from gptcore.tokenizer import token_byte_lengths

SCHEDULE_KEYS = ("lr", "warmup", "schedule", "min_lr_ratio", "decay_fraction")  # optim.*
Report = Callable[[dict[str, float], dict[str, Any]], None]


BF16_MIN_SPEEDUP = 1.5  # auto on a CPU: bf16 when its matmul is at least this much faster than fp32


def resolve_precision(name: str, device: torch.device) -> tuple[str, str]:
    """`train.precision` made concrete for `device`: ("fp32" | "bf16", why, for the first log line).

    auto: bf16 on a GPU that has bf16 units; on a CPU, bf16 when its bf16 matmul measured at least
    `BF16_MIN_SPEEDUP` x its fp32 matmul (measured, cached with the MFU peak by
    `gptcore.mfu`): a CPU without bf16 units (AMX, AVX512-BF16) emulates it, often slower than
    fp32. fp32 elsewhere."""
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported(including_emulation=False)  # the current device's
        gpu = torch.cuda.get_device_name(device)
        if name == "bf16" and not supported:
            raise UserError(f"train.precision=bf16 but {gpu} has no bf16 units; use fp32 or auto")
        if name == "auto":
            return ("bf16", f"auto: {gpu} has bf16") if supported else ("fp32", f"auto: {gpu} has no bf16")
    elif device.type == "cpu" and name == "auto":
        speedup = cpu_matmul_flops("bf16") / cpu_matmul_flops("fp32")
        if speedup >= BF16_MIN_SPEEDUP:
            return "bf16", f"auto: bf16 matmul {speedup:.1f}x fp32 on this CPU"
        return "fp32", f"auto: bf16 matmul {speedup:.2g}x fp32 on this CPU, under {BF16_MIN_SPEEDUP}x"
    elif name == "auto":
        return "fp32", f"auto: bf16 is only chosen on cuda and cpu, not {device.type}"
    return name, "set in train.precision"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward + loss context of `precision`: bf16 autocast (matmuls in bf16; weights,
    gradients and optimizer state stay fp32; the model computes its loss in fp32), or fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def dropout_seed(seed: int, rank: int, batch_index: int) -> int:
    """The torch seed of one training step's dropout masks on one rank.

    Model init uses `train.seed` alone, so every rank starts from the same weights; dropout must
    then differ between ranks (N ranks drawing one mask would average N copies of the same noise),
    and being a pure function of the data position keeps resume and rollbacks exact."""
    state = np.random.SeedSequence([seed, rank, batch_index]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1  # 63 bits: within torch.manual_seed's range


@contextlib.contextmanager
def hold_interrupts() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block ends, then deliver it to the previous handler.

    A KeyboardInterrupt raised inside a step would leave it half done (the batch index moved, the
    optimizer not stepped, or only some parameters updated), and a checkpoint taken then would
    resume off by a batch. Signals reach only the main thread, so elsewhere (Ray Train workers)
    this does nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        signal.raise_signal(signal.SIGINT)


def open_data(cfg: ExperimentConfig) -> TokenData:
    """The prepared data of `cfg`, checked against the model and the stage it will feed."""
    data = open_prepared(cfg.data.dir)
    kind = "sft" if isinstance(data, ChatData) else "pretrain"
    if kind != cfg.train.stage:
        holds = "conversations (gptrun prepare --sft)" if kind == "sft" else "documents, not conversations"
        raise UserError(
            f"train.stage={cfg.train.stage!r} but data folder {cfg.data.dir} holds {holds}; set "
            f"train.stage={kind!r} or point data.dir at {'SFT' if kind == 'pretrain' else 'pretraining'} data"
        )
    if data.vocab_size != cfg.model.vocab_size:
        raise UserError(
            f"data folder {cfg.data.dir} has a {data.vocab_size}-token tokenizer but "
            f"model.vocab_size={cfg.model.vocab_size}; set --set model.vocab_size="
            f"{data.vocab_size} or re-prepare the data"
        )
    return data


class Trainer:
    """One training run: model, optimizer, data, the step, evaluation, guards and state."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        log: Callable[[str], None] | None = print,
    ) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.log = log if rank == 0 and log is not None else (lambda _msg: None)
        self.device = device or resolve_device(cfg.train.device)
        use_tf32(self.device)
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        torch.manual_seed(cfg.train.seed)
        self.data = open_data(cfg)
        t = cfg.train  # this rank's micro-batches, built ahead of the step (`_micro_batch`)
        make = functools.partial(
            self.data.train_batch,
            seed=t.seed,
            rank=rank,
            world_size=world_size,
            batch_size=t.batch_size,
            grad_accum=t.grad_accum,
            seq_len=cfg.model.seq_len,
        )
        self.batches = Prefetcher(make, t.grad_accum, self.device)
        self.model = GPT(cfg.model)
        self.lora_base: dict[str, str] | None = None  # a LoRA run's base checkpoint (path, weights hash)
        if cfg.train.init_from:
            self._init_from(cfg.train.init_from)
        if cfg.lora.rank:
            self.lora_base = base_record(cfg.train.init_from, self.model.state_dict())
            lora_summary = add_lora(self.model, cfg.lora)
        self.model.to(self.device)
        # What train_step calls: DDP wraps the model here, torch.compile wraps that in `fit`
        # (`_choose_compile`). Checkpoints and evaluation use `self.model`, never a wrapper.
        self.eager_step_model = wrap(self.model) if wrap is not None else self.model
        self.step_model = self.eager_step_model
        self.compile_decided = False
        self.optimizer = AdamW(
            param_groups(
                self.model,
                cfg.optim.weight_decay,
                cfg.optim.decay_embeddings,
                cfg.model.width_mult if cfg.model.mup_base_width else None,
            ),
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            eps=cfg.optim.eps,
        )
        length = run_length(cfg, world_size)
        self.tokens_per_step, self.total_steps = length.tokens_per_step, length.total_steps
        self.flops_per_token = self.model.flops_per_token(cfg.model.seq_len)
        self.precision, self.precision_reason = self._rank0_choice(
            *resolve_precision(cfg.train.precision, self.device)
        )
        self.peak_flops, self.peak_source = device_peak_flops(self.device, self.precision)
        self.peak_remeasured = False  # an MFU over 100% re-measures a CPU's peak once
        self.tokenizer_json = self.data.tokenizer_text()  # every checkpoint carries its tokenizer
        # UTF-8 bytes of each token id, for bits per byte on exactly the tokens evaluated.
        self.token_bytes = torch.from_numpy(token_byte_lengths(Tokenizer.from_str(self.tokenizer_json))).to(
            self.device
        )
        # Progress: a resume restores all of it; a rollback only the weights, optimizer and step.
        self.step = 0  # optimizer steps taken: the schedule's position
        self.batch_index = 0  # batches consumed, including skipped ones: the data position
        self.tokens_seen = 0  # tokens of every applied step, rolled back or not: never decreases
        # Divergence guard: kept across rollbacks (each one halves lr_scale again).
        self.lr_scale = 1.0
        self.bad_streak = 0
        self.bad_steps = 0
        self.rollbacks = 0
        self.best_val_loss = math.inf
        self.resumed_from = 0  # the step this process started at (0 for a fresh run)
        self._snapshot: dict[str, Any] | None = None  # last checkpoint, for rollbacks
        # The guard's device side (see `train_step`): the lr of every step, and the step, streak
        # and lr scale that the queued steps advance before the host reads their outcome.
        exact = scalar_dtype(self.device)
        schedule = [lr_at(s, self.total_steps, cfg.optim) for s in range(self.total_steps + 1)]
        self._lr_table = torch.tensor(schedule, dtype=exact, device=self.device)
        self._device_step = torch.zeros((), dtype=torch.long, device=self.device)
        self._device_streak = torch.zeros((), dtype=torch.long, device=self.device)
        self._device_lr_scale = torch.ones((), dtype=exact, device=self.device)
        if cfg.train.init_from:
            self.log(f"weights from {cfg.train.init_from}" + (f" | {lora_summary}" if cfg.lora.rank else ""))

    def _rank0_choice(self, *choice: Any) -> list[Any]:
        """Rank 0's values for all ranks: ranks measuring one machine at once could land either
        side of an auto bar (precision, compile)."""
        values = list(choice)
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(values, src=0)
        return values

    def _init_from(self, path: str) -> None:
        """Start from a checkpoint's weights (a LoRA one merged): same shape and tokenizer, fresh
        optimizer and schedule. The SFT stage starts this way from a pretrained model."""
        state = load_checkpoint(path)
        self._check_fits(
            state,
            f"train.init_from {path}",
            shape_fix="use the [model] section of the run that wrote it",
            tokenizer_fix="prepare the data with --tokenizer set to the pretraining data's tokenizer.json",
        )
        self.model.load_state_dict(model_from_state(state).state_dict())

    # ---------------------------------------------------------------- the training step
    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum` micro-batches, queued without waiting for the
        device. A non-finite loss or gradient skips the update by a device-side flag (the host
        never reads it here), and the guard's streak and lr scale advance on the device too, so
        the steps queued after a skip use the lr today's guard would. The host learns the outcome
        at the next `_read_outcomes` (once per log interval) and does its part of the guard then.

        Returns the step's record: loss (this rank's), grad_norm, lr and applied as device tensors,
        the batch index and the seconds spent building batches."""
        t, o = self.cfg.train, self.cfg.optim
        index = self._device_step.clamp(max=self.total_steps)  # past the end: a test's extra steps
        lr = torch.take(self._lr_table, index) * self._device_lr_scale
        set_lr(self.optimizer, lr)
        self.step_model.train()
        torch.manual_seed(dropout_seed(t.seed, self.rank, self.batch_index))
        loss_sum = torch.zeros((), device=self.device)
        data_seconds = 0.0
        for micro in range(t.grad_accum):
            start = time.perf_counter()
            x, y = self._micro_batch(micro)
            data_seconds += time.perf_counter() - start
            # DDP all-reduces gradients on the last micro-step only.
            last = micro == t.grad_accum - 1
            sync = (
                contextlib.nullcontext()
                if last or not hasattr(self.step_model, "no_sync")
                else self.step_model.no_sync()
            )
            with sync, autocast(self.device, self.precision):
                _, loss = self.step_model(x, y)
                (loss / t.grad_accum).backward()
            loss_sum += loss.detach()
        batch = self.batch_index
        self.batch_index += 1
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = o.grad_clip if o.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        loss = loss_sum / t.grad_accum
        finite = torch.isfinite(loss).float()
        if self.world_size > 1:  # every rank must agree whether to skip; the reduce does not wait
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        applied = (finite > 0) & torch.isfinite(grad_norm)  # the norm is the same on every rank
        self.optimizer.step(apply=applied)
        self.optimizer.zero_grad(set_to_none=True)
        # The guard's device side: a streak of max_bad_steps halves the lr scale. The host rolls
        # the weights back (if it has a snapshot) when it reads the flags.
        self._device_step += applied
        streak = torch.where(applied, 0, self._device_streak + 1)
        rollback = streak >= t.max_bad_steps
        self._device_lr_scale = torch.where(rollback, self._device_lr_scale * 0.5, self._device_lr_scale)
        self._device_streak = torch.where(rollback, 0, streak)
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "applied": applied,
            "batch": batch,
            "data_seconds": data_seconds,
        }

    def _read_outcomes(self, records: list[dict[str, Any]]) -> list[dict[str, float]]:
        """The host's read of queued steps: one host sync for all of them (and under DDP one
        all-reduce of their losses, the loss being averaged over ranks only when it is read)."""
        losses = torch.stack([r["loss"] for r in records])
        if self.world_size > 1:
            dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        columns = [losses] + [torch.stack([r[k] for r in records]) for k in ("grad_norm", "lr", "applied")]
        rows = torch.stack([c.to(self._lr_table.dtype) for c in columns], dim=1).tolist()
        return [
            {
                "loss": loss,
                "grad_norm": norm,
                "lr": lr,
                "skipped": 1.0 - applied,
                "data_seconds": r["data_seconds"],
                "batch": float(r["batch"]),
            }
            for (loss, norm, lr, applied), r in zip(rows, records, strict=True)
        ]

    def _account(self, outcome: dict[str, float]) -> bool:
        """The host's part of the guard for one step whose outcome it has read: count an applied
        step, or skip, roll back or give up (`_on_bad_step`). True when a rollback restored the
        snapshot: the steps queued after this one trained from the wrong weights and are dropped,
        and the data position moves back to the batch after this one (batches and dropout are
        functions of the batch index, so the run goes on exactly as if the host had known)."""
        if not outcome["skipped"]:
            self.bad_streak = 0
            self.step += 1
            self.tokens_seen += self.tokens_per_step
            return False
        if not self._on_bad_step(outcome["loss"]):
            return False
        self.batch_index = int(outcome["batch"]) + 1
        return True

    def _guard_to_device(self) -> None:
        """Copy the host's exact step, streak and lr scale to the device side of the guard."""
        self._device_step.fill_(self.step)
        self._device_streak.fill_(self.bad_streak)
        self._device_lr_scale.fill_(self.lr_scale)

    def _micro_batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `micro` of this rank's share of the current step's batch, on the device:
        built ahead by `self.batches` while the previous step ran, and copied without blocking the
        host (pinned memory) on CUDA."""
        x, y = self.batches.get(self.batch_index, micro)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _on_bad_step(self, loss_value: float) -> bool:
        """The recipe's guard: skip, then roll back and halve the lr, then give up. True when the
        weights were rolled back to the snapshot."""
        self.bad_steps += 1
        self.bad_streak += 1
        self.log(
            f"warning: non-finite loss ({loss_value}) at step {self.step}; batch skipped "
            f"({self.bad_streak} in a row)"
        )
        if self.bad_streak < self.cfg.train.max_bad_steps:
            return False
        if self.rollbacks >= self.cfg.train.max_rollbacks:
            raise DivergedError(
                f"loss was non-finite for {self.bad_streak} steps in a row after "
                f"{self.rollbacks} rollbacks (lr scale {self.lr_scale:g}); "
                "lower optim.lr or raise optim.warmup"
            )
        restored = self._snapshot is not None
        if restored:  # data moves on: the bad batches stay skipped
            self._restore_weights(self._snapshot)
        self.rollbacks += 1
        self.lr_scale *= 0.5
        self.bad_streak = 0
        self.log(
            f"warning: rolled back to step {self.step} with lr scale {self.lr_scale:g} "
            f"(rollback {self.rollbacks}/{self.cfg.train.max_rollbacks})"
        )
        return restored

    # ---------------------------------------------------------------- torch.compile
    def _choose_compile(self) -> str:
        """Settle `train.compile` (see `gptcore.autocompile`): time the eager model step, decide,
        compile and measure what compiling cost and gained. Returns the line for the log. A
        failing compile (an unsupported op, no C compiler) leaves the run eager."""
        setting = self.cfg.train.compile
        if setting is False:
            return "compile off (train.compile=false)"
        key = autocompile.cost_key(self.device, self.cfg, self.precision)
        self._time_model_step(self.model)  # warm-up: allocator, autocast caches
        eager_steps = self._model_steps(self.model)
        eager_seconds = min(eager_steps)
        if setting == "auto":
            micro_steps_left = (self.total_steps - self.step) * self.cfg.train.grad_accum
            on, line = autocompile.decide(
                micro_steps_left, eager_seconds, autocompile.expected_cost(key, self.device)
            )
        else:
            on, line = True, "compile on (train.compile=true)"
        on, line = self._rank0_choice(on, line)
        if not on:
            return line
        autocompile.share_compile_cache()
        compiled = torch.compile(self.eager_step_model)
        try:
            first_seconds = self._time_model_step(compiled)  # compiles forward and backward
        except Exception as err:  # torch raises many types: BackendCompilerFailed, InductorError, ...
            self.optimizer.zero_grad(set_to_none=True)
            reason = next((s for s in str(err).splitlines() if s.strip()), "")[:200]
            return f"warning: torch.compile failed, training eager ({type(err).__name__}: {reason})"
        self.step_model = compiled
        compiled_steps = self._model_steps(compiled)
        compiled_seconds = min(compiled_steps)
        seconds = max(first_seconds - compiled_seconds, 0.0)
        if self.rank == 0:  # a shape compiled before in this process says nothing of a new run's cost
            first = autocompile.first_compile_here(key)
            autocompile.record(key, seconds if first else None, eager_steps, compiled_steps)
        return (
            f"{line} | compiled in {duration(seconds)}: model step {eager_seconds * 1e3:.0f} "
            f"-> {compiled_seconds * 1e3:.0f} ms ({eager_seconds / compiled_seconds:.2f}x)"
        )

    def _model_steps(self, model: nn.Module, timings: int = 3) -> list[float]:
        """A few timed model steps: samples of a duration, of which the shortest is the least
        slowed by other work on the machine (`gptcore.measured.Measured`)."""
        return [self._time_model_step(model) for _ in range(timings)]

    def _time_model_step(self, model: nn.Module) -> float:
        """Seconds of one forward + backward of `model` on the next training batch, gradients
        then dropped: progress, weights and optimizer stay as they were (dropout draws from the
        RNG, which every step seeds anew)."""
        x, y = self._micro_batch(0)
        model.train()
        self.synchronize()
        start = time.perf_counter()
        with autocast(self.device, self.precision):
            _, loss = model(x, y)
        loss.backward()
        self.synchronize()
        seconds = time.perf_counter() - start
        self.optimizer.zero_grad(set_to_none=True)
        return seconds

    def synchronize(self) -> None:
        """Wait for the device: steps queue their work and return before it is done."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the fixed validation slice (split across ranks, then all-reduced), and
        bits per byte over the UTF-8 bytes of exactly the target tokens evaluated."""
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # nats, tokens, bytes
        for x, y in self.data.val_batches(
            seq_len=self.cfg.model.seq_len,
            batch_size=self.cfg.train.batch_size,
            eval_tokens=self.cfg.train.eval_tokens,
            rank=self.rank,
            world_size=self.world_size,
        ):
            x, y = x.to(self.device), y.to(self.device)
            with autocast(self.device, self.precision):
                _, loss = self.model(x, y)
            counted = y != IGNORE_INDEX  # SFT evaluates assistant tokens only
            totals[0] += loss.double() * counted.sum()
            totals[1] += counted.sum()
            totals[2] += (self.token_bytes[y.clamp_min(0)] * counted).sum()
        if self.world_size > 1:
            dist.all_reduce(totals)
        nats, count, nbytes = totals.tolist()
        val_loss = nats / max(count, 1)
        return {
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50.0)),
            "val_bpb": nats / math.log(2) / max(nbytes, 1),
        }

    # ---------------------------------------------------------------- the run
    def fit(self, on_report: Report | None = None, stop_at_step: int | None = None) -> dict:
        """Train to the run length. At every eval: evaluate, maybe checkpoint, call `on_report`.

        `stop_at_step` ends early (after that step's report), for tests and interruptions.
        Returns the last metrics, with `status` "completed"."""
        t = self.cfg.train
        end = self.total_steps if stop_at_step is None else min(stop_at_step, self.total_steps)
        self.log(run_length_line(self.cfg, self.world_size))
        if self.step == 0:
            self.log(
                f"model: {self.model.num_params() / 1e6:.2f}M parameters, "
                f"{self.flops_per_token / 1e6:.1f} MFLOP/token | device {self.device} | precision "
                f"{self.precision} ({self.precision_reason}) | MFU peak {self.peak_source}"
            )
            if isinstance(self.data, ChatData):
                self.log(self.data.beyond_windows(self.cfg.model.seq_len))
        if not self.compile_decided:
            self.log(self._choose_compile())
            self.compile_decided = True
        if self.step == 0 and t.init_from:  # the starting point, to show what fine-tuning gained
            self.log(f"eval step 0 (weights of train.init_from) | val loss {self.evaluate()['val_loss']:.4f}")
        metrics: dict[str, float] = {}
        reported_step = -1
        window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
        queued: list[dict[str, Any]] = []  # steps whose outcome the host has not read yet

        def catch_up() -> None:
            """Read the queued steps' outcomes (the host sync) and do, step by step, what the
            host does after each: the guard, the progress line, the evaluation."""
            nonlocal metrics, reported_step, window_start, window_steps, window_data
            outcomes = self._read_outcomes(queued) if queued else []
            queued.clear()
            for step_metrics in outcomes:
                rewound = self._account(step_metrics)
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
                if rewound:
                    break
            self._guard_to_device()

        self._guard_to_device()
        try:
            while self.step < end:
                # Ctrl-C waits for the step and its scheduled evaluation: a checkpoint taken
                # between the two would resume after the step, and its evaluation would never
                # be recorded.
                with hold_interrupts():
                    queued.append(self.train_step())
                    # The host reads the outcomes only where it may have something to do: where
                    # the step would reach a log, eval or end point if every queued step applied.
                    # An applied step can reach such a point only there; a skipped one there or
                    # in between (its progress line is then logged late, in order).
                    ahead = self.step + len(queued)
                    if ahead % t.log_interval == 0 or ahead % t.eval_interval == 0 or ahead >= end:
                        catch_up()
        except KeyboardInterrupt:  # the caller checkpoints: the host state must be exact
            catch_up()
            raise
        if reported_step != self.step:  # stopped between evals: report and checkpoint here
            base = {"step": float(self.step), "tokens": float(self.tokens_seen)}
            metrics = self._report({**metrics, **base}, on_report, checkpoint=True)
        return {**metrics, "status": "completed"}

    def _throughput(
        self, step_metrics: dict[str, float], elapsed: float, steps: int, data_seconds: float
    ) -> dict[str, float]:
        tokens_per_sec = self.tokens_per_step * steps / max(elapsed, 1e-9)
        per_device = tokens_per_sec / self.world_size
        if data_seconds > 0.1 * elapsed:
            self.log(
                f"warning: data loading took {100 * data_seconds / elapsed:.0f}% of step "
                "time; the loader is a bottleneck"
            )
        return {
            "step": float(self.step),
            "tokens": float(self.tokens_seen),
            "loss": step_metrics["loss"],
            "lr": step_metrics["lr"],
            "grad_norm": step_metrics["grad_norm"],
            "tokens_per_sec": tokens_per_sec,
            "mfu": self._checked_mfu(per_device),
            "eta_sec": (self.total_steps - self.step) * elapsed / max(steps, 1),
            "bad_steps": float(self.bad_steps),
            "rollbacks": float(self.rollbacks),
        }

    def _checked_mfu(self, tokens_per_sec: float) -> float:
        """MFU against the peak; 0 (logged n/a) where the peak is unknown. An MFU over 100% proves
        the peak too low: a CPU's is measured again, once; if the MFU is still over, one warning
        and n/a from then on, never an impossible figure."""
        value = mfu(tokens_per_sec, self.flops_per_token, self.peak_flops)
        if value <= 1.0:
            return value
        if self.device.type == "cpu" and not self.peak_remeasured:
            self.peak_remeasured = True
            old = self.peak_flops
            reached = tokens_per_sec * self.flops_per_token
            self.peak_flops, self.peak_source = device_peak_flops(self.device, self.precision, reached)
            value = mfu(tokens_per_sec, self.flops_per_token, self.peak_flops)
            self.log(
                f"MFU was {100 * mfu(tokens_per_sec, self.flops_per_token, old):.0f}% of a peak of "
                f"{old / 1e9:.1f} GFLOP/s, so that peak was too low: measured again, "
                f"{self.peak_flops / 1e9:.1f} GFLOP/s"
            )
            if value <= 1.0:
                return value
        self.log(
            f"warning: MFU would be {100 * value:.0f}% of the peak ({self.peak_source}); that peak "
            "is wrong, so MFU is n/a for this run"
        )
        self.peak_flops = 0.0
        return 0.0

    def _log_progress(self, m: dict[str, float]) -> None:
        mfu_text = f"{100 * m['mfu']:.1f}%" if self.peak_flops else "n/a"
        self.log(
            f"step {self.step:>6}/{self.total_steps} | loss {m['loss']:.4f} | "
            f"lr {m['lr']:.2e} | grad norm {m['grad_norm']:.3f} | "
            f"{m['tokens_per_sec'] / 1e3:.1f}k tok/s | MFU {mfu_text} | "
            f"ETA {duration(m['eta_sec'])}"
        )

    def _report(
        self, metrics: dict[str, float], on_report: Report | None, checkpoint: bool = False
    ) -> dict[str, float]:
        evaluation = self.evaluate()
        self.best_val_loss = min(self.best_val_loss, evaluation["val_loss"])
        metrics = {
            **metrics,
            **evaluation,
            "best_val_loss": self.best_val_loss,
            "resumed_from": float(self.resumed_from),
        }
        self.log(
            f"eval step {self.step} | val loss {evaluation['val_loss']:.4f} | "
            f"ppl {evaluation['val_ppl']:.2f} | bpb {evaluation['val_bpb']:.4f}"
        )
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
        optimizer = _to_cpu(self.optimizer.state_dict())
        for group in optimizer["param_groups"]:  # a device tensor while training, a number here
            group["lr"] = float(group["lr"])
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return copy.deepcopy(
            {
                "model": self._weights(),
                "optimizer": optimizer,
                "step": self.step,
                "batch_index": self.batch_index,
                "tokens_seen": self.tokens_seen,
                "lr_scale": self.lr_scale,
                "bad_steps": self.bad_steps,
                "rollbacks": self.rollbacks,
                "best_val_loss": self.best_val_loss,
                "rng": rng,
                "config": self.cfg.to_dict(),
                "tokenizer_sha256": self.data.tokenizer_sha256,
                "tokenizer_json": self.tokenizer_json,
                "metrics": dict(metrics or {}),
                "world_size": self.world_size,
                "precision": self.precision,  # informational: weights and optimizer are fp32
                **({"lora_base": self.lora_base} if self.lora_base else {}),
            }
        )

    def _weights(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores of the model: all weights, or a LoRA run's adapters alone."""
        if self.lora_base:
            return adapter_weights(self.model)
        return {k: v.detach().float().cpu() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint: weights, optimizer, progress and guard state. Refuses one
        from another model shape, tokenizer or lr schedule (see `_check_schedule`)."""
        self._check_fits(
            state,
            "checkpoint",
            shape_fix="use a new train.out folder or the checkpoint's config",
            tokenizer_fix="point data.dir at the original data folder",
        )
        saved = model_world_config(state["config"])
        if state.get("lora_base", {}).get("weights_sha256") != (self.lora_base or {}).get("weights_sha256"):
            raise UserError(
                "checkpoint's LoRA base differs from this run's train.init_from and [lora]; "
                "use a new train.out folder or the checkpoint's config"
            )
        self._check_schedule(saved, state)
        self._restore_weights(state)
        for key in ("batch_index", "tokens_seen", "lr_scale", "bad_steps", "rollbacks", "best_val_loss"):
            setattr(self, key, state[key])
        self._guard_to_device()
        self.resumed_from = self.step
        self._snapshot = state
        saved_precision = state.get("precision")  # absent from checkpoints older than the key
        if saved_precision not in (None, self.precision):
            self.log(
                f"checkpoint was trained in {saved_precision}, this run is {self.precision} "
                f"({self.precision_reason}); weights and optimizer state are fp32 in both"
            )

    def _check_fits(self, state: dict[str, Any], source: str, *, shape_fix: str, tokenizer_fix: str) -> None:
        """Refuse weights of another model shape or tokenizer than this run's."""
        diff = _differences(model_world_config(state["config"]).model, self.cfg.model, SHAPE_KEYS, "")
        if diff:
            raise UserError(f"{source} is from another model shape ({'; '.join(diff)}); {shape_fix}")
        if state["tokenizer_sha256"] != self.data.tokenizer_sha256:
            raise UserError(
                f"{source} was trained with another tokenizer than the one in {self.cfg.data.dir}; "
                f"{tokenizer_fix}"
            )

    def _check_schedule(self, saved: ExperimentConfig, state: dict[str, Any]) -> None:
        """A resumed run keeps the lr schedule it started with: a changed optim schedule key is
        refused, and so is another run length unless `train.extend` asks for it (the schedule
        is then recomputed for the new length from the checkpoint's step on)."""
        diff = _differences(saved.optim, self.cfg.optim, SCHEDULE_KEYS, "optim.")
        if diff:
            raise UserError(
                f"checkpoint was trained with another lr schedule ({'; '.join(diff)});"
                " use a new train.out folder or the checkpoint's values"
            )
        steps = run_length(saved, state["world_size"]).total_steps
        if steps == self.total_steps:
            return
        if not self.cfg.train.extend:
            raise UserError(
                f"checkpoint is from a {steps}-step run but this config makes "
                f"{self.total_steps} steps, which would change the lr schedule "
                "mid-run; to change the run's length on purpose add --set "
                "train.extend=true, otherwise use a new train.out folder"
            )
        self.log(
            f"train.extend: the run's length goes from {steps} to {self.total_steps} steps; "
            f"the lr schedule is recomputed for {self.total_steps} steps from step "
            f"{state['step']}"
        )

    def _restore_weights(self, state: dict[str, Any]) -> None:
        """What a rollback restores: model, optimizer, step and RNG states, not the guard."""
        if self.lora_base:
            load_adapters(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)


def _differences(saved: Any, current: Any, keys: tuple[str, ...], prefix: str) -> list[str]:
    """`prefix+key: saved vs current` for each of `keys` whose value differs."""
    return [
        f"{prefix}{k}: {getattr(saved, k)} vs {getattr(current, k)}"
        for k in keys
        if getattr(saved, k) != getattr(current, k)
    ]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
