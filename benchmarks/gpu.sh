#!/usr/bin/env bash
# The checks a CUDA machine gets (only there: this project is developed on CPUs). Needs python3
# with torch, tokenizers, numpy and tqdm (no Ray), and data/shakespeare prepared beforehand:
#   gptrun prepare --corpus shakespeare --out data/shakespeare
#   benchmarks/gpu.sh [OUT]
# 1. step throughput and MFU (bf16 autocast) for the quickstart and minimind-26m shapes;
# 2. `train --local` of both configs on the GPU (device auto, bf16, nccl-free single process),
#    minimind-26m with and without torch.compile;
# 3. resume on CUDA: 20 steps + resume + 20 against 40 uninterrupted (bf16 on a GPU is not bit
#    for bit deterministic: embedding backward uses atomics), printed as the largest loss gap.
set -euo pipefail
out=${1:-/tmp/gptrun-gpu}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

python3 benchmarks/step.py --device cuda

mm=(--set train.max_tokens=0 --set train.max_steps=60 --set train.log_interval=10
    --set train.eval_interval=30 --set train.eval_tokens=65536 --set train.grad_accum=1)
python3 -m experiments train experiments/configs/quickstart.toml --local --set train.out="$out/qs" \
    --set train.max_steps=300 --set train.batch_size=64
python3 -m experiments train experiments/configs/minimind-26m.toml --local --set train.out="$out/mm" "${mm[@]}"
python3 -m experiments train experiments/configs/minimind-26m.toml --local \
    --set train.out="$out/mm-compiled" --set train.compile=true "${mm[@]}"

python3 - <<'EOF'
from experiments.config import load_experiment
from gptcore.train import Trainer

cfg = load_experiment("experiments/configs/quickstart.toml",
                      ["train.max_steps=40", "train.eval_interval=20", "train.out='/tmp/resume'"])
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
print(f"resume on {full.device}: step {second.step} vs {full.step}; largest weight gap {gap:.3g}; "
      f"val loss {second.evaluate()['val_loss']:.4f} vs {full.evaluate()['val_loss']:.4f}")
EOF
