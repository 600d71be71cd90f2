"""Model FLOPs utilization: achieved training FLOP/s over the device's peak.

MFU = tokens/s * flops_per_token / peak (PaLM, appendix B), against the peak of the precision the
run uses (`train.precision`). The peak on a GPU is the dense (no structured sparsity) bf16
tensor-core figure from the vendor's datasheet, the convention of PaLM and nanoGPT; an fp32 run
on a GPU is measured against that same bf16 figure (its log says so), so it reports a low MFU on
purpose. A CPU has no datasheet figure we can look up portably, so its fp32 and bf16 matmul peaks
are measured once per (CPU model, thread count, torch version) and cached on disk; the two also
decide `train.precision = "auto"` on a CPU. gptrun's own processes take turns (a file lock beside
the cache: one measures, the others wait and read its figure).

Other work on the machine can only make a measured peak too low, never too high, and a peak too
low inflates every later MFU. So a peak follows `gptcore.measured.Measured`: the best of several
samples, measured again when something contradicts it. Two things do: a figure below the one of
fewer threads (more threads are never slower: if it is still lower measured again, the
fewer-thread figure stands), and an MFU over 100% (the trainer passes the rate it reached; if the
peak is still below it measured again, the trainer says so and reports MFU n/a).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from gptcore.measured import Measured, table_path

# Dense bf16 tensor-core peak FLOP/s by a substring of torch.cuda.get_device_name(), matched
# case-insensitively, longest key first (so "H100 PCIE" wins over "H100", "A100" over "A10").
# Sources: NVIDIA datasheets for A100, H100 (SXM 989.4, PCIe 756, NVL 835), H200, B200, L40S,
# L40, L4, A10 (A10G: AWS's variant, listed as A10), RTX A6000, Ada/Ampere GeForce whitepapers
# (RTX 4090 165.2 and RTX 3090 71 with fp32 accumulate); V100 and T4 have no bf16, their fp16
# tensor peak is given; AMD MI300X/MI250X from AMD's datasheets.
PEAK_BF16_FLOPS: dict[str, float] = {
    "B200": 2250e12,
    "H200": 989e12,
    "H100 PCIE": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "A6000": 155e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,  # fp16
    "T4": 65e12,  # fp16
    "MI300X": 1307e12,
    "MI250X": 383e12,
}

PEAKS = Measured("cpu_peak_flops.json", best=max)  # FLOP/s: a rate, so the highest sample
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def device_peak_flops(device: torch.device | str, precision: str, reached: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s, a description for logs) of `device` computing in `precision` ("fp32" or
    "bf16"); peak 0.0 means unknown, so MFU is reported n/a. `reached`: FLOP/s a run achieved,
    which a CPU's peak must not be below (see `cpu_matmul_flops`)."""
    device = torch.device(device)
    if precision not in DTYPES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(DTYPES)}")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        upper = name.upper()
        for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
            if key in upper:
                peak = PEAK_BF16_FLOPS[key]
                note = "" if precision == "bf16" else "; the run is fp32, so its MFU is low on purpose"
                return peak, f"{name}: {peak / 1e12:.0f} TFLOP/s dense bf16 (datasheet){note}"
        return 0.0, f"unknown GPU {name!r}: add its peak to gptcore.mfu.PEAK_BF16_FLOPS"
    if device.type == "cpu":
        peak = cpu_matmul_flops(precision, reached)
        return peak, (
            f"{_cpu_name()}, {torch.get_num_threads()} threads: {peak / 1e9:.1f} GFLOP/s {precision} "
            f"matmul (the best sample, cached in {table_path(PEAKS.table)}; measured "
            "again if an MFU goes over 100%)"
        )
    return 0.0, f"no peak known for device type {device.type!r}"


def cpu_matmul_flops(precision: str, reached: float = 0.0) -> float:
    """This CPU's matmul FLOP/s in `precision` with torch's current thread count, cached (`PEAKS`).

    A cached figure below the one of fewer threads, or below `reached` (FLOP/s a run achieved), is
    proved too low and measured again. Still below the fewer-thread figure, that figure stands
    (and is kept, so that no later start measures again); still below `reached`, it is returned
    as it is, for the caller to flag."""
    threads = torch.get_num_threads()
    cached = PEAKS.read()
    fewer = max((cached.get(_cpu_key(n, precision), 0.0) for n in range(1, threads)), default=0.0)
    key, dtype = _cpu_key(threads, precision), DTYPES[precision]
    peak = PEAKS.figure(key, lambda: _measure_matmul_flops(dtype=dtype), lambda f: f >= max(fewer, reached))
    if peak is None or peak < fewer:  # more threads are never slower: the fewer-thread figure stands
        peak = PEAKS.add(key, fewer) or 0.0
    return peak


def _cpu_key(threads: int, precision: str) -> str:
    key = f"{_cpu_name()}|threads={threads}|torch={torch.__version__}"
    return key if precision == "fp32" else f"{key}|{precision}"  # fp32: the key older caches hold


def mfu(tokens_per_sec: float, flops_per_token: float, peak_flops: float) -> float:
    """Fraction of the device's peak used by training (0..1); 0 when the peak is unknown."""
    if peak_flops <= 0:
        return 0.0
    return tokens_per_sec * flops_per_token / peak_flops


def machine_name(device: torch.device) -> str:
    """What a measurement on `device` holds for: the GPU's name, or the CPU's with its threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_name()}|threads={torch.get_num_threads()}" if device.type == "cpu" else device.type


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _measure_matmul_flops(n: int = 1024, seconds: float = 0.5, dtype: torch.dtype = torch.float32) -> float:
    """Best rate of an n x n matmul in `dtype` over ~`seconds`, with torch's current thread count:
    one sample of a peak. It runs under the cache's lock (`Measured.figure`): trials starting
    together on a fresh node would otherwise all measure at once, each on a share of the CPU.
    On a CPU without bf16 units a bf16 matmul can be 100-1000x slower than fp32 (7-20 s for one
    here): the warm-up then stops early, and a first matmul longer than `seconds` is the sample
    (what a warm-up would save is nothing beside it)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    start = time.perf_counter()
    for i in range(3):  # warm-up: thread pool start, page faults, oneDNN kernel selection
        torch.mm(a, b, out=out)
        elapsed = time.perf_counter() - start
        if i == 0 and elapsed > seconds:
            return 2.0 * n**3 / elapsed
        if elapsed > seconds / 4:
            break
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = max(best, 2.0 * n**3 / (time.perf_counter() - t0))
    return best
