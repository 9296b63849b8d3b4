#!/usr/bin/env python3
"""Which cuBLAS kernel (tile shape) torch.matmul picks for a few bf16 problems on this card, and its
clock, power and energy efficiency in sustained running (power_probe.py's method): what the dense
reference's efficiency depends on.

    python3 bench/expert_mlp/cublas_tiles.py [SECONDS] [M,N,K ...]
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from power_probe import PEAK_TFLOPS_PER_GHZ, median_clock_power, run_sampled  # noqa: E402

DEFAULT = ["8192,8192,8192", "8192,7168,2048", "8192,4096,7168", "8192,2048,8192", "16384,2048,768", "8192,1536,2048"]


def kernel_name(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return names[-1] if names else "?"


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    shapes = [tuple(int(v) for v in s.split(",")) for s in (sys.argv[2:] or DEFAULT)]
    work = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        fn = lambda a=a, b=b: torch.matmul(a, b)  # noqa: E731
        fn()
        work.append((f"{m}x{n}x{k}", 2.0 * m * n * k, fn, kernel_name(fn)))
    runs, smi = run_sampled([(name, fn, lambda: None) for name, _, fn, _ in work], seconds)
    rows = [(name, flops / ms / 1e9, start, end, kernel)
            for (name, _, ms, start, end), (_, flops, _, kernel) in zip(runs, work)]
    print(f"{'M x N x K':<18} {'TFLOP/s':>8} {'MHz':>6} {'W':>5} {'of peak/clk':>11} {'TFLOP/kJ':>9}  kernel")
    for name, tflops, start, end, kernel in rows:
        sampled = median_clock_power(smi, start, end)
        if sampled is None:
            print(f"{name:<18} {tflops:8.0f}  (no clock samples)  {kernel[:90]}")
            continue
        mhz, watts, _, _ = sampled
        print(f"{name:<18} {tflops:8.0f} {mhz:6.0f} {watts:5.0f} {tflops / (mhz / 1e3) / PEAK_TFLOPS_PER_GHZ:11.1%} "
              f"{tflops / watts * 1e3:9.0f}  {kernel[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
