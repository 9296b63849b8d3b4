"""Dense matrix-product ceilings on this GPU, for the FP8 expert GEMMs' figures (issue 41): BF16
torch.mm and FP8 torch._scaled_mm (per-tensor and rowwise scales) at the expert GEMMs' sizes, timed
with CUDA events (median of --iters after --warmup), in TFLOP/s.

    python3 bench/fp8_gemm/ceiling.py [--out ceiling.json]
"""
import argparse
import json

import torch

# (name, M, N, K): a DeepSeek-V3 rank's W13 and W2 forward GEMMs, Qwen3-30B-A3B's, a square one.
SHAPES = [
    ("deepseek_w13", 32768, 4096, 7168),
    ("deepseek_w2", 32768, 7168, 2048),
    ("qwen3_w13", 65536, 1536, 2048),
    ("square_8192", 8192, 8192, 8192),
]


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(name, M, N, K, warmup, iters):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * M * N * K
    row = {"name": name, "M": M, "N": N, "K": K}
    row["bf16_mm_tflops"] = flops / median_ms(lambda: torch.mm(a, b.t()), warmup, iters) / 1e9
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    row["fp8_scaled_mm_tensorwise_tflops"] = flops / median_ms(
        lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), warmup, iters) / 1e9
    sa = torch.rand(M, 1, device="cuda") + 0.5
    sb = torch.rand(1, N, device="cuda") + 0.5
    try:
        row["fp8_scaled_mm_rowwise_tflops"] = flops / median_ms(
            lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), warmup, iters) / 1e9
    except RuntimeError as e:  # rowwise scaling needs a recent PyTorch
        row["fp8_scaled_mm_rowwise_error"] = str(e).splitlines()[0]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    rows = [measure(*shape, args.warmup, args.iters) for shape in SHAPES]
    for r in rows:
        print(r["name"], {k: round(v, 1) for k, v in r.items() if k.endswith("tflops")})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
