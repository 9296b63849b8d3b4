#!/usr/bin/env python3
"""Clock, power and cycle efficiency of the expert-MLP GEMMs next to dense cuBLAS, on this card.

The H200 here runs power-limited: a kernel's TFLOP/s is (FLOP per SM cycle) x (the clock its power
draw leaves). This separates the two. Each workload runs back to back for SECONDS while nvidia-smi
samples the SM clock and board power every 50 ms; per workload it prints the achieved TFLOP/s, the
median clock and power, TFLOP/s per GHz against the tensor peak per GHz (132 SMs x 4096 bf16 FLOP per
cycle = 540.7 TFLOP/s per GHz: the cycle efficiency) and TFLOP per kJ (the energy efficiency).

    python3 bench/expert_mlp/power_probe.py LIB [OUT.json] [SECONDS] [SHAPES] [NAME_FILTER]

SHAPES: comma-separated keys of bench_expert_mlp.SHAPES (default: all) or DIAGNOSTIC_SHAPES
("dense_8192": FPROP W2 is then cuBLAS's 8192^3 problem, Poise's GEMM core next to cuBLAS on the
same work); NAME_FILTER: only the
workloads whose name contains one of its comma-separated parts (dense cuBLAS always runs, as the
reference); a part containing "accumulate" adds WGRAD W13 accumulating into an fp32 and a bf16
gradient buffer.
"""
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_expert_mlp as bench  # noqa: E402
from smi_sampler import SmiSampler, median_clock_power as median_of_samples  # noqa: E402

PEAK_TFLOPS_PER_GHZ = 132 * 4096 / 1e3


def run_for(fn, seconds):
    """Calls fn back to back for `seconds`; returns (calls, ms per call, start, end) in host time."""
    fn()
    torch.cuda.synchronize()
    start = time.time()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    calls = 0
    while time.time() - start < seconds:
        for _ in range(4):
            fn()
        calls += 4
        if calls % 32 == 0:
            torch.cuda.synchronize()  # keep the host within reach of the GPU
    e.record()
    torch.cuda.synchronize()
    return calls, s.elapsed_time(e) / calls, start, time.time()


def run_sampled(workloads, seconds):
    """Runs each (name, fn, prepare) back to back for `seconds`, after prepare() and 1 s idle (the same
    start for each), while nvidia-smi samples the SM clock and board power every 50 ms. Returns
    [(name, calls, ms per call, start, end)] and the sampler (median_clock_power reads it)."""
    runs = []
    with SmiSampler() as smi:
        time.sleep(1.0)
        for name, fn, prepare in workloads:
            prepare()
            time.sleep(1.0)
            runs.append((name, *run_for(fn, seconds)))
    return runs, smi


def median_clock_power(smi, start, end):
    """(median clock MHz, median power W, the throttle reasons seen, samples) inside [start, end],
    the first 0.3 s (the ramp) skipped; None without samples."""
    return median_of_samples(smi.samples_between(start, end, skip_s=0.3))


def main() -> int:
    lib_path = sys.argv[1]
    out_path = sys.argv[2] if len(sys.argv) > 2 else None
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 2.5
    P = bench.open_poise(lib_path)
    dev, bf = "cuda", torch.bfloat16
    workloads = []  # the calls keep their block's buffers alive

    n = 8192
    a, b = torch.randn(n, n, device=dev, dtype=bf), torch.randn(n, n, device=dev, dtype=bf)
    # (name, FLOP per call, call, prepare): prepare sets the bench library's problem (its row layout
    # and shape are global state, last set by the last layout() call).
    workloads.append(("dense torch.matmul 8192^3", 2.0 * n**3, lambda: torch.matmul(a, b), lambda: None))
    shapes = sys.argv[4].split(",") if len(sys.argv) > 4 else list(bench.SHAPES)
    keys = sys.argv[5].split(",") if len(sys.argv) > 5 else None  # NAME_FILTER's parts
    # PROBE_SKEWS: routings per shape (bench.make_routing's target; 0 = every expert a whole number
    # of 128-row blocks, the padding's diagnostic); default the balanced one.
    skews = [float(s) for s in os.environ.get("PROBE_SKEWS", "1").split(",")]
    for shape, skew in [(shape, skew) for shape in shapes for skew in skews]:
        c = bench.ready_block(P, shape, skew)
        xs, offs = bench.grouped_mm_operands(c.x, c.ids, c.E, c.K)
        tag = {"deepseek_v3_ep8_rank": "DeepSeek-V3", "qwen3_30b_a3b": "Qwen3"}.get(shape, shape)
        if len(skews) > 1:
            tag += f" {bench.routing_name(skew)}"
        w13_flops = 4.0 * c.T * c.K * c.D * c.F
        prepare = lambda c=c: c.blk.layout(c.ids, c.scores)  # noqa: E731
        grouped_mm = lambda xs=xs, w13=c.w13, offs=offs: torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # noqa: E731
        workloads += [
            (f"{tag} poise fprop_w13", w13_flops, c.gemm_calls["fprop_w13"], prepare),
            (f"{tag} torch._grouped_mm W13", w13_flops, grouped_mm, prepare),
            (f"{tag} poise fprop_w2", w13_flops / 2, c.gemm_calls["fprop_w2"], prepare),
            (f"{tag} poise dgrad_w2", w13_flops / 2, c.gemm_calls["dgrad_w2"], prepare),
            (f"{tag} poise dgrad_w13", w13_flops, c.gemm_calls["dgrad_w13"], prepare),
            (f"{tag} poise wgrad_w2", w13_flops / 2, c.gemm_calls["wgrad_w2"], prepare),
            (f"{tag} poise wgrad_w13", w13_flops, c.gemm_calls["wgrad_w13"], prepare),
        ]
        if hasattr(P.lib, "pb_fprop_w2_combine"):
            # FPROP W2 / DGRAD W13 with the top-k combine: the separate glue kernel after the GEMM, or
            # fused into it (zeroing the target first).
            blk, gemm = c.blk, c.gemm_calls
            workloads += [
                (f"{tag} poise fprop_w2+combine", w13_flops / 2,
                 lambda blk=blk, gemm=gemm, c=c: (gemm["fprop_w2"](), blk.combine(blk.y_rows, c.out)), prepare),
                (f"{tag} poise fprop_w2 fused combine", w13_flops / 2,
                 lambda blk=blk, c=c: blk.fprop_w2_fused_combine(c.w2, c.out), prepare),
                (f"{tag} poise dgrad_w13+combine", w13_flops,
                 lambda blk=blk, gemm=gemm, c=c: (gemm["dgrad_w13"](), blk.combine(blk.gx_rows, c.gx)), prepare),
                (f"{tag} poise dgrad_w13 fused combine", w13_flops,
                 lambda blk=blk, c=c: blk.dgrad_w13_fused_combine(c.w13, c.gx), prepare),
            ]
        if keys and any("accumulate" in k for k in keys):
            # Gradient accumulation into an existing buffer (Megatron's fp32 main_grad, or bf16): only
            # when asked for, the fp32 buffer is E x 2F x D x 4 bytes (3.8 GB at DeepSeek-V3).
            c.g13_fp32 = torch.zeros(c.E, 2 * c.F, c.D, device=dev, dtype=torch.float32)
            blk = c.blk
            workloads += [
                (f"{tag} poise wgrad_w13 fp32 accumulate", w13_flops,
                 lambda blk=blk, g=c.g13_fp32: P.wgrad_w13(blk.gh13, blk.x_rows, g, 1, 1), prepare),
                (f"{tag} poise wgrad_w13 bf16 accumulate", w13_flops,
                 lambda blk=blk, g=c.g13: P.wgrad_w13(blk.gh13, blk.x_rows, g, 0, 1), prepare),
            ]

    if keys:
        workloads = [w for w in workloads if w[0].startswith("dense torch.matmul") or any(k in w[0] for k in keys)]
    runs, log = run_sampled([(name, fn, prepare) for name, _, fn, prepare in workloads], seconds)
    records = [dict(name=name, calls=calls, ms=ms, tflops=flops / ms / 1e9, start=start, end=end)
               for (name, calls, ms, start, end), (_, flops, _, _) in zip(runs, workloads)]
    print(f"{'workload':<34} {'TFLOP/s':>8} {'MHz':>6} {'W':>6} {'TF/s per GHz':>13} {'of peak':>8} {'TFLOP/kJ':>9}  reasons")
    for r in records:
        sampled = median_clock_power(log, r["start"], r["end"])
        if sampled is None:
            print(f"{r['name']:<34} {r['tflops']:8.0f}  (no clock samples)")
            continue
        mhz, watts, reasons, samples = sampled
        per_ghz = r["tflops"] / (mhz / 1e3)
        r.update(sm_mhz=mhz, power_w=watts, samples=samples, tflops_per_ghz=per_ghz,
                 cycle_efficiency=per_ghz / PEAK_TFLOPS_PER_GHZ, tflop_per_kj=r["tflops"] / watts * 1e3,
                 clock_event_reasons=reasons)
        print(f"{r['name']:<34} {r['tflops']:8.0f} {mhz:6.0f} {watts:6.0f} {per_ghz:13.0f} {per_ghz / PEAK_TFLOPS_PER_GHZ:8.1%} "
              f"{r['tflop_per_kj']:9.0f}  {','.join(reasons)}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
