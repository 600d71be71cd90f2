"""Model FLOPs utilization: achieved training FLOP/s over the device's peak.

MFU = tokens/s * flops_per_token / peak (PaLM, appendix B), against the peak of the precision the
run uses (`train.precision`). The peak on a GPU is the dense (no structured sparsity) bf16
tensor-core figure from the vendor's datasheet, the convention of PaLM and nanoGPT; an fp32 run
on a GPU is measured against that same bf16 figure (its log says so), so it reports a low MFU on
purpose. A CPU has no datasheet figure we can look up portably, so its fp32 and bf16 matmul peaks
are measured once per (CPU model, thread count, torch version) and cached on disk; the two also
decide `train.precision = "auto"` on a CPU. gptrun's own processes take turns (a file lock beside
the cache: one measures, the others wait and read its figure), but other processes busy during
that one measurement lower the figure (and inflate every later MFU): delete the cache file to
measure again.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from gptcore.measured import locked_table, table_path

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

_CACHE_FILE = "cpu_peak_flops.json"
_measured: dict[str, float] = {}  # this process's CPU measurements, by cache key
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def device_peak_flops(device: torch.device | str, precision: str) -> tuple[float, str]:
    """(peak FLOP/s, a description for logs) of `device` computing in `precision` ("fp32" or
    "bf16"); peak 0.0 means unknown, so MFU is reported n/a."""
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
        peak = cpu_matmul_flops(precision)
        return peak, (
            f"{_cpu_name()}, {torch.get_num_threads()} threads: {peak / 1e9:.1f} GFLOP/s {precision} "
            f"matmul (measured once, cached in {table_path(_CACHE_FILE)}; delete it to re-measure)"
        )
    return 0.0, f"no peak known for device type {device.type!r}"


def cpu_matmul_flops(precision: str) -> float:
    """This CPU's measured matmul FLOP/s in `precision` with torch's current thread count."""
    key = f"{machine_name(torch.device('cpu'))}|torch={torch.__version__}"
    if precision != "fp32":  # the fp32 key is the one caches written before bf16 already hold
        key += f"|{precision}"
    return _cpu_peak_flops(key, DTYPES[precision])


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


def _cpu_peak_flops(key: str, dtype: torch.dtype) -> float:
    """Measured matmul FLOP/s for this key, from memory, the disk cache, or a ~1 s run. The
    measurement runs under the cache's lock: trials starting together on a fresh node would
    otherwise all measure at once, each on a share of the CPU, and cache a fraction of its peak."""
    if key in _measured:
        return _measured[key]
    with locked_table(_CACHE_FILE) as table:
        if not isinstance(table.get(key), (int, float)):
            table[key] = _measure_matmul_flops(dtype=dtype)
        _measured[key] = float(table[key])
    return _measured[key]


def _measure_matmul_flops(n: int = 1024, seconds: float = 1.0, dtype: torch.dtype = torch.float32) -> float:
    """Best rate of an n x n matmul in `dtype` over ~`seconds`, with torch's current thread count.
    On a CPU without bf16 units a bf16 matmul can be 10-100x slower than fp32: the warm-up then
    stops early, so the measurement stays within a few seconds."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    start = time.perf_counter()
    for _ in range(3):  # warm-up: thread pool start, page faults, oneDNN kernel selection
        torch.mm(a, b, out=out)
        if time.perf_counter() - start > seconds / 4:
            break
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = max(best, 2.0 * n**3 / (time.perf_counter() - t0))
    return best
