#!/usr/bin/env bash
# The checks a CUDA machine gets (only there: this project is developed on CPUs), in at most 8
# minutes on one H100: every part has its own time limit, and a part that fails or runs out of
# time prints FAILED and the script goes on; the exit status is 1 if any part failed. Needs python3
# with torch, tokenizers, numpy and tqdm (and ray[tune] for the sweep part), and data/shakespeare
# prepared beforehand:
#   gptrun prepare --corpus shakespeare --out data/shakespeare
#   benchmarks/gpu.sh [OUT]
# 1. step throughput and MFU in bf16, torch.compile'd, for quickstart, minimind-26m and gpt2-124m,
#    against nanoGPT's model.py and AdamW at the same shape (benchmarks/step.py --baseline nanogpt);
# 2. AdamW: gptcore's, torch's foreach and torch's fused, fastest first (benchmarks/adamw.py);
# 3. torch.compile modes: default vs max-autotune-no-cudagraphs, compile seconds and step time;
# 4. host syncs per training step (torch.cuda.set_sync_debug_mode counts them);
# 5. a 2-trial sweep with resources.gpus_per_worker = 0.5: two trials share the GPU;
# 6. resume on CUDA: 20 steps + resume + 20 against 40 uninterrupted (bf16 on a GPU is not bit
#    for bit deterministic: embedding backward uses atomics), printed as the largest weight gap.
set -uo pipefail # no -e: a failed part is reported, and the parts after it still run
out=${1:-/tmp/gptrun-gpu}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
failed=()

# part NAME SECONDS COMMAND...: run COMMAND for at most SECONDS; record it as FAILED otherwise.
part() {
    local name=$1 limit=$2 start=$SECONDS rc=0
    shift 2
    echo
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    if ((rc == 0)); then
        echo "== $name: ok in $((SECONDS - start))s"
        return
    fi
    local why="exit $rc"
    if ((rc == 124 || rc == 137)); then
        why="out of time"
    fi
    echo "== $name: FAILED ($why, after $((SECONDS - start))s)"
    failed+=("$name")
}

part "machine" 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader &&
    python3 -c \"import torch; print('torch', torch.__version__, torch.cuda.get_device_name())\""

bench=(--device cuda --precision bf16 --optimizers ours --modes compiled --baseline nanogpt --steps 10 --warmup 3)
part "step MFU: quickstart, minimind-26m vs nanoGPT" 110 \
    python3 benchmarks/step.py "${bench[@]}" --presets quickstart minimind-26m
part "step MFU: gpt2-124m (batch 16 x 1024) vs nanoGPT" 100 \
    python3 benchmarks/step.py "${bench[@]}" --presets gpt2-124m --batch-size 16 --seq-len 1024

part "AdamW: fused vs foreach vs gptcore" 30 python3 benchmarks/adamw.py --device cuda

part "torch.compile modes (minimind-26m, batch 32 x 512, bf16)" 70 python3 - <<'EOF'
import time

import torch

from gptcore.config import load_config
from gptcore.device import use_tf32
from gptcore.model import GPT
from gptcore.optim import AdamW, param_groups
from gptcore.train import autocast

device, steps = torch.device("cuda"), 20
use_tf32(device)
cfg = load_config(None, ['model.preset="minimind-26m"', "model.seq_len=512"]).model
x, y = torch.randint(cfg.vocab_size, (2, 32, 512), device=device)
for mode in ("default", "max-autotune-no-cudagraphs"):  # the default first: it prints even if the other runs out of time
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    optimizer = AdamW(param_groups(model, 0.1), lr=1e-4)
    compiled = torch.compile(model, mode=mode)

    def step() -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with autocast(device, "bf16"):
            _, loss = compiled(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        return time.perf_counter() - start

    first = step()
    for _ in range(3):
        step()
    seconds = sorted(step() for _ in range(steps))[steps // 2]
    print(f"  mode={mode:<28} compiled in {first - seconds:5.1f}s | {seconds * 1e3:6.2f} ms/step "
          f"(median of {steps}) | {x.numel() / seconds:,.0f} tok/s")
    torch._dynamo.reset()
EOF

part "host syncs per training step (quickstart, eager)" 35 python3 - <<'EOF'
import collections
import warnings

import torch

from experiments.ray_config import load_experiment
from gptcore.train import Trainer

cfg = load_experiment("experiments/configs/quickstart.toml",
                      ["train.compile=false", "train.out='/tmp/gptrun-gpu-syncs'"])
trainer = Trainer(cfg, log=None)
for _ in range(3):
    trainer.train_step()  # warm-up: allocator, autocast caches, the prefetch thread
steps = 20
torch.cuda.synchronize(trainer.device)
torch.cuda.set_sync_debug_mode("warn")  # a warning at every op that makes the host wait
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(steps):
        trainer.train_step()
torch.cuda.set_sync_debug_mode("default")
syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
print(f"  {len(syncs)} host syncs in {steps} train_step calls on {trainer.device}: "
      f"{len(syncs) / steps:g} per step (the goal between log intervals: 0)")
for message, count in collections.Counter(syncs).most_common(3):
    print(f"  {count} x {message}")
EOF

part "sweep: 2 trials sharing one GPU (resources.gpus_per_worker = 0.5)" 80 \
    python3 -m experiments sweep experiments/configs/quickstart.toml --name gpu-share --restart \
    --storage "$out/sweeps" --set resources.gpus_per_worker=0.5 --set sweep.num_samples=2 \
    --set train.max_steps=100 --set train.eval_interval=50 --set train.compile=false

part "resume on CUDA" 40 python3 - <<'EOF'
from experiments.ray_config import load_experiment
from gptcore.train import Trainer

cfg = load_experiment("experiments/configs/quickstart.toml",
                      ["train.max_steps=40", "train.eval_interval=20", "train.compile=false",
                       "train.out='/tmp/gptrun-gpu-resume'"])
full = Trainer(cfg, log=None)
full.fit()
saved = {}
first = Trainer(cfg, log=None)
first.fit(on_report=lambda m, s: saved.update(state=s) if s else None, stop_at_step=20)
second = Trainer(cfg, log=None)
second.load_state_dict(saved["state"])
second.fit()
gap = max((a - b).abs().max().item() for a, b in
          zip(full.model.parameters(), second.model.parameters(), strict=True))
print(f"  resume on {full.device}: step {second.step} vs {full.step}; largest weight gap {gap:.3g}; "
      f"val loss {second.evaluate()['val_loss']:.4f} vs {full.evaluate()['val_loss']:.4f}")
EOF

echo
if ((${#failed[@]})); then
    echo "gpu.sh: ${#failed[@]} part(s) FAILED in ${SECONDS}s: ${failed[*]}"
    exit 1
fi
echo "gpu.sh: all parts ok in ${SECONDS}s"
