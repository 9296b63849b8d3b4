#!/usr/bin/env python3
"""The FP8 forward of issue 41: Poise FP8 vs Poise BF16, eager PyTorch FP8 and the eager BF16 baseline.

Through the public Python API, one EP rank's routed experts at the shapes of
bench/routed_experts/bench.py (DeepSeek-V3 EP8 rank, Qwen3-30B-A3B), balanced routing by default,
the same seeded inputs for every side; forward only, under torch.no_grad. Sides:
  baseline         bench/routed_experts/bench.py's baseline_forward (sort-permute + torch._grouped_mm
                   + SwiGLU + torch._grouped_mm + score multiply + index_add_), BF16
  peer_fp8         the same chain in FP8 as eager PyTorch has it: x quantized per token (rowwise,
                   amax / 448), the weights per expert and output channel once outside the timed region,
                   torch._scaled_grouped_mm for W13 and W2 (fp32 rowwise scales, bf16 out), SwiGLU in
                   bf16, a quantized per row between them
  poise_bf16       poise.routed_experts on a one-rank context of the default (bf16) Config
  poise_fp8        the same with gemm_precision='fp8_block_scaled' (the context quantizes the BF16
                   weights into 128 x 128 blocks every call, x and a into 1 x 128 row tiles)
  poise_fp8_prep   poise_fp8 with prepared weights (poise.prepare_weights once, outside the timing, as an
                   optimizer step would; routed_experts(..., prepared=)): no per-call weight quantization
  poise_bf16_inf,  the same two on contexts with inference=True (no activation slots); --no-inference
  poise_fp8_inf    leaves them out
Every side's blocks alternate (bench/timing.py's time_block), so the card's drift hits all alike.
Also recorded: the dense W13 GEMM ceilings at the shape's size (bench/fp8_gemm/ceiling.py's measure),
each side's TFLOP/s (forward flops 2*T*K*D*2F + 2*T*K*F*D), and each side's out against the
baseline's (relative L2; FP8 sides must be under 0.12, BF16 sides under 2e-2: a broken kernel shows).

Usage: python3 bench/fp8_forward/bench.py [--out FILE] [--commit SHA] [--shapes ...] [--skews 1,3]
Needs an SM90 GPU and the poise module built (pip install .). About 70 s on an H200 with --blocks 3 (7 sides x 3 blocks x 2 shapes).
"""
from __future__ import annotations

import pathlib
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as Fn

BENCH = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # bench/: the routed-experts bench, the FP8 ceiling, clocks, commit
from fp8_gemm.ceiling import measure as measure_ceiling  # noqa: E402
from routed_experts.bench import (  # noqa: E402
    SHAPES, TOLERANCE as BF16_TOLERANCE, baseline_forward, case_arguments, make_inputs, parse_case_arguments,
    poise_config, rel_err, routing_name, run_benchmark, timing_record)
from timing import time_block  # noqa: E402

DEFAULT_OUT = "bench/results/fp8_forward_h200.json"
# FP8 against the BF16 baseline: 3-7e-2 relative L2 expected (docs/fp8.md: 6-8% from float64 on one
# expert group); a broken kernel or a wrong scale is far beyond.
FP8_TOLERANCE = 0.12
FP8_SIDES = ("peer_fp8", "poise_fp8", "poise_fp8_prep", "poise_fp8_inf")
SIDES = ("baseline", "peer_fp8", "poise_bf16", "poise_fp8", "poise_fp8_prep", "poise_bf16_inf", "poise_fp8_inf")
# (numerator side, denominator side): ratio = numerator's ms / poise's ms, > 1 when Poise is faster.
RATIOS = (("poise_fp8", "poise_bf16"), ("poise_fp8", "peer_fp8"), ("poise_fp8", "baseline"),
          ("poise_fp8_prep", "poise_bf16"), ("poise_fp8_prep", "peer_fp8"), ("poise_fp8_prep", "baseline"),
          ("poise_fp8_inf", "poise_bf16_inf"), ("poise_fp8_inf", "peer_fp8"), ("poise_fp8_inf", "baseline"))
GOALS = {("deepseek_v3_ep8_rank", "poise_fp8_vs_poise_bf16"): 1.7,  # issue 41
         ("deepseek_v3_ep8_rank", "poise_fp8_prep_vs_poise_bf16"): 1.7}
E4M3_MAX = 448.0
# torch._scaled_grouped_mm's 2D x 3D form with rowwise scales: torch's own tests
# (test_scaled_matmul_cuda.py, generate_jagged_offs) and torchtitan / torchao's FP8 MoE training pad
# every expert's rows to a multiple of 16 (the CUTLASS kernel's TMA loads want 16-byte-aligned group
# starts); so does the peer, by default. --peer-align 1 runs it on unpadded groups.
PEER_ROW_ALIGN = 16


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    ap = case_arguments(DEFAULT_OUT, "1")
    ap.description = __doc__.split("\n")[0]
    ap.add_argument("--peer-align", type=int, default=PEER_ROW_ALIGN,
                    help=f"peer_fp8: rows per expert padded to a multiple of this (default {PEER_ROW_ALIGN}; 1: none)")
    ap.add_argument("--no-inference", action="store_true", help="leave out the inference-context sides")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the dense W13 GEMM ceilings")
    ap.add_argument("--ceiling-iters", type=int, default=20, help="timed calls per ceiling GEMM (median)")
    args = parse_case_arguments(ap, argv, positive=("blocks", "reps", "peer_align", "ceiling_iters"))
    args.sides = [s for s in SIDES if not (args.no_inference and s.endswith("_inf"))]
    return args


# ---------------------------------------------------------------- peer_fp8: eager PyTorch FP8
def quantize_rows(t):
    """Rowwise E4M3 of t [..., K] (bf16): scale = amax / 448 per row over the last dim (zero rows get a
    tiny scale, so 0 / scale = 0), values clamped to +-448 (torch's cast does not saturate).
    Returns (float8_e4m3fn like t, fp32 scales of t's shape without the last dim, contiguous)."""
    scale = (t.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp_min(1e-12)
    q = (t.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1).contiguous()


class PeerWeights(NamedTuple):
    """The peer's prepared weights: each expert's W13 [2F, D] and W2 [D, F] rowwise (per output
    channel) in E4M3, as stored (row-major [E, N, K]; the GEMMs read them transposed, column-major)."""
    w13: torch.Tensor  # float8_e4m3fn [E, 2F, D]
    s13: torch.Tensor  # fp32 [E, 2F]
    w2: torch.Tensor  # float8_e4m3fn [E, D, F]
    s2: torch.Tensor  # fp32 [E, D]


def peer_weights(w13_E2FD, w2_EDF):
    with torch.no_grad():
        w13, s13 = quantize_rows(w13_E2FD.detach())
        w2, s2 = quantize_rows(w2_EDF.detach())
    return PeerWeights(w13, s13, w2, s2)


def gather_rows_fp8(q, index):
    """q [rows, K] float8 gathered by index (through a uint8 view: the same bytes, whatever the
    float8 index kernels this torch has)."""
    return q.view(torch.uint8).index_select(0, index).view(torch.float8_e4m3fn)


def peer_fp8_forward(x_TD, ids_TK, scores_TK, weights: PeerWeights, align=PEER_ROW_ALIGN):
    """Eager FP8 routed experts: x quantized per token (row-local, so the same bits as per routed row
    after the permute, for 1/K of the work), sort-permute (rows per expert padded to a multiple of
    align, the padding rows reading token 0: computed, never read), torch._scaled_grouped_mm for W13,
    SwiGLU in bf16, a quantized per row, torch._scaled_grouped_mm for W2, score multiply, index_add_.
    No host sync: the padded buffers have their static bound T*K + E*(align - 1) rows (rows past the
    last group are left unwritten by the GEMMs and never read)."""
    T, K = ids_TK.shape
    E = weights.w13.shape[0]
    flat = ids_TK.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    tok = order // K
    x_q, x_s = quantize_rows(x_TD)
    if align > 1:
        padded = (counts + (align - 1)) // align * align
        ends = torch.cumsum(padded, 0)
        offs = ends.to(torch.int32)
        expert = flat.index_select(0, order)  # each sorted row's expert
        # sorted row i of expert e: its rank in e is i - (start of e in sorted order); its padded
        # row is the padded start of e plus that rank
        starts = torch.cumsum(counts, 0) - counts
        dest = torch.arange(T * K, device=flat.device) - starts.index_select(0, expert) \
            + (ends - padded).index_select(0, expert)
        src = torch.zeros(T * K + E * (align - 1), dtype=torch.int64, device=flat.device)
        src.index_copy_(0, dest, tok)
    else:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        dest, src = None, tok
    h = torch._scaled_grouped_mm(gather_rows_fp8(x_q, src), weights.w13.transpose(1, 2), x_s.index_select(0, src),
                                 weights.s13, offs=offs, out_dtype=torch.bfloat16)
    g, u = h.chunk(2, dim=-1)
    a_q, a_s = quantize_rows(Fn.silu(g) * u)
    y = torch._scaled_grouped_mm(a_q, weights.w2.transpose(1, 2), a_s, weights.s2, offs=offs,
                                 out_dtype=torch.bfloat16)
    if dest is not None:
        y = y.index_select(0, dest)
    y = y * scores_TK.flatten().index_select(0, order).unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x_TD).index_add_(0, tok, y)


# ---------------------------------------------------------------- the sides
def no_grad(fn):
    def call():
        with torch.no_grad():
            return fn()
    return call


def poise_side_config(side, T, D, F, E, K):
    import dataclasses

    return dataclasses.replace(poise_config(T, D, F, E, K),
                               gemm_precision="fp8_block_scaled" if "fp8" in side else "bf16",
                               inference=side.endswith("_inf"))


def build_sides(name, inputs, args):
    """({side: forward under no_grad}, {poise side: its context}, {side: why it is unavailable}).
    A side whose setup or first call raises is recorded unavailable and left out of the timing."""
    import poise

    T, D, F, E, K = SHAPES[name]
    x, s, w13, w2 = (inputs[n] for n in ("x_TD", "scores_TK", "w13_E2FD", "w2_EDF"))
    calls, contexts, unavailable = {}, {}, {}
    for side in args.sides:
        try:
            if side == "baseline":
                calls[side] = no_grad(lambda: baseline_forward(x, inputs["ids_TK"], s, w13, w2))
            elif side == "peer_fp8":
                if not hasattr(torch, "_scaled_grouped_mm"):
                    raise NotImplementedError(f"torch {torch.__version__} has no torch._scaled_grouped_mm")
                pw = peer_weights(w13, w2)
                calls[side] = no_grad(lambda pw=pw: peer_fp8_forward(x, inputs["ids_TK"], s, pw, args.peer_align))
            else:
                ctx = poise.create_context(config=poise_side_config(side, T, D, F, E, K), device="cuda")
                contexts[side] = ctx
                prepared = poise.prepare_weights(w13, w2) if side == "poise_fp8_prep" else None
                calls[side] = no_grad(lambda ctx=ctx, prepared=prepared: poise.routed_experts(
                    x, inputs["ids32_TK"], s, w13, w2, ctx, prepared=prepared))
        except Exception as e:  # noqa: BLE001  recorded, the rest goes on
            unavailable[side] = f"{type(e).__name__}: {e}"
            print(f"{side} unavailable: {unavailable[side]}", flush=True)
    return calls, contexts, unavailable


def run_checked(side, run, calls, contexts, unavailable):
    """run() for one side, then its context's check(): the result, or None when either raised (the
    side then moves from calls to unavailable)."""
    try:
        result = run()
        torch.cuda.synchronize()
        if side in contexts:
            contexts[side].check()
        return result
    except Exception as e:  # noqa: BLE001  recorded, the rest goes on
        unavailable[side] = f"{type(e).__name__}: {e}"
        print(f"{side} unavailable: {unavailable[side]}", flush=True)
        del calls[side]
        return None


def check_sides(calls, contexts, unavailable):
    """Relative L2 of each side's out against the baseline's (and poise_fp8's against peer_fp8's and
    poise_fp8_prep's, which must be the same bits);
    a side whose call raises moves to unavailable."""
    want = calls["baseline"]()
    outs, errors = {}, {}
    for side in [s for s in calls if s != "baseline"]:
        out = run_checked(side, calls[side], calls, contexts, unavailable)
        if out is None:
            continue
        errors[side] = rel_err(out, want)
        if side in ("poise_fp8", "peer_fp8", "poise_fp8_prep"):
            outs[side] = out
    if "poise_fp8" in outs and "peer_fp8" in outs:
        errors["poise_fp8_vs_peer_fp8"] = rel_err(outs["poise_fp8"], outs["peer_fp8"])
    if "poise_fp8" in outs and "poise_fp8_prep" in outs:  # the same bits: 0 expected
        errors["poise_fp8_prep_vs_poise_fp8"] = rel_err(outs["poise_fp8_prep"], outs["poise_fp8"])
    return errors


def tolerance(side):
    return FP8_TOLERANCE if side in FP8_SIDES else BF16_TOLERANCE


# ---------------------------------------------------------------- timing
def timed_blocks(calls, args):
    """{f"{side}_ms": [block medians]} and the blocks' windows, the sides alternated block by block."""
    ms, spans = {}, {}
    for _ in range(args.blocks):
        for side in calls:
            block_ms, span = time_block(calls[side], args.reps, args.settle_s, args.warm_ms)
            ms.setdefault(f"{side}_ms", []).append(block_ms)
            spans.setdefault(f"{side}_ms", []).append(span)
    return ms, spans


def ceiling(name, args):
    """bench/fp8_gemm/ceiling.py's dense BF16 / FP8 GEMMs at the shape's W13 forward GEMM size
    (M = T*K rows, N = 2F, K = D), TFLOP/s; {"error": ...} if it raises."""
    T, D, F, E, K = SHAPES[name]
    try:
        row = measure_ceiling(f"{name}_w13", T * K, 2 * F, D, 5, args.ceiling_iters)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------- records
def timed_entries(block_ms, sides, flops):
    """{side: {"ms": median over blocks, "tflops", "block_ms"}} for the sides that were timed."""
    entries = {}
    for side in sides:
        if f"{side}_ms" in block_ms:
            ms = statistics.median(block_ms[f"{side}_ms"])
            entries[side] = {"ms": ms, "tflops": flops / ms / 1e9, "block_ms": block_ms[f"{side}_ms"]}
    return entries


def case_record(name, skew_target, skew, block_ms, errors, unavailable, ceiling_row, args):
    T, D, F, E, K = SHAPES[name]
    flops = 2.0 * T * K * D * 2 * F + 2.0 * T * K * F * D
    rec = {"shape": name, "T": T, "D": D, "F": F, "E_local": E, "K": K, "routing": routing_name(skew_target),
           "skew": round(skew, 3), "flops_fwd": flops, "peer_align": args.peer_align,
           "sides": timed_entries(block_ms, SIDES, flops)}
    for side, entry in rec["sides"].items():
        if side != "baseline":
            entry.update(rel_err_out_vs_baseline=errors[side], tolerance=tolerance(side),
                         correct=errors[side] < tolerance(side))
    rec["unavailable"] = unavailable
    for pair in ("poise_fp8_vs_peer_fp8", "poise_fp8_prep_vs_poise_fp8"):
        if pair in errors:
            rec[f"rel_err_{pair}"] = errors[pair]
    rec["ratios"] = {}  # the other side's ms / Poise FP8's ms: > 1 when Poise FP8 is faster
    for fp8, other in RATIOS:
        if fp8 in rec["sides"] and other in rec["sides"]:
            rec["ratios"][f"{fp8}_vs_{other}"] = rec["sides"][other]["ms"] / rec["sides"][fp8]["ms"]
    rec["goals"] = {k: v for (shape, k), v in GOALS.items() if shape == name}
    rec["ceiling_w13"] = ceiling_row
    for key in ("fp8_scaled_mm_tensorwise_tflops", "fp8_scaled_mm_rowwise_tflops"):
        if ceiling_row and key in ceiling_row and "poise_fp8" in rec["sides"]:
            rec[f"poise_fp8_of_{key.removesuffix('_tflops')}"] = rec["sides"]["poise_fp8"]["tflops"] / ceiling_row[key]
    # the Poise sides must run and be right; an unavailable peer is recorded, not a failure
    # prepared weights give the call's own quantization's bits
    rec["correct"] = (poise_sides_ran_and_correct(rec, args.sides)
                      and errors.get("poise_fp8_prep_vs_poise_fp8", 0.0) == 0.0)
    return rec


def poise_sides_ran_and_correct(rec, sides):
    """Every Poise side among ``sides`` ran, and no side that ran is wrong (an unavailable peer is
    recorded, not a failure)."""
    return (all(s in rec["sides"] for s in sides if s.startswith("poise"))
            and all(v.get("correct", True) for v in rec["sides"].values()))


def report(records, args, commit, device, started):
    return {"benchmark": "fp8_forward", "commit": commit, "device": device, "torch": torch.__version__,
            "timing": timing_record(args, "forward under torch.no_grad; CUDA events around each call from an idle "
                                          "GPU; per block the median of reps calls after settle_s idle and warm_ms "
                                          "of warm-up; the sides' blocks alternated; records hold the median over "
                                          "blocks"),
            "sides": {
                "baseline": "bench/routed_experts/bench.py baseline_forward: eager BF16 sort-permute + "
                            "torch._grouped_mm + SwiGLU + torch._grouped_mm + scores + index_add_",
                "peer_fp8": "eager FP8: x rowwise per token (amax/448), weights rowwise per expert and output "
                            "channel prepared once (untimed), torch._scaled_grouped_mm W13 and W2 (bf16 out), "
                            "SwiGLU bf16, a rowwise; rows per expert padded to peer_align",
                "poise_bf16": "poise.routed_experts, one-rank context, default Config (bf16), training context",
                "poise_fp8": "the same with gemm_precision='fp8_block_scaled' (BF16 weights quantized into "
                             "128x128 blocks every call; x and a in 1x128 row tiles)",
                "poise_fp8_prep": "poise_fp8 with weights prepared once (poise.prepare_weights, untimed) and "
                                  "passed as routed_experts(..., prepared=)",
                "poise_bf16_inf": "poise_bf16 on a context with inference=True",
                "poise_fp8_inf": "poise_fp8 on a context with inference=True"},
            "config": {"ep_size": 1, "balance": "capacity", "receive_capacity_factor": 1.0, "scores": "fp32"},
            "tolerance": {"bf16": BF16_TOLERANCE, "fp8": FP8_TOLERANCE},
            "ratios": "the other side's ms / the Poise FP8 side's ms (> 1: Poise FP8 faster)",
            "seconds": round(time.perf_counter() - started, 1), "cases": records}


def print_table(records):
    for r in records:
        c = r["ceiling_w13"] or {}
        ceil = ", ".join(f"{k.removesuffix('_tflops')} {v:.0f}" for k, v in c.items() if k.endswith("_tflops"))
        print(f"\n{r['shape']} {r['routing']} (skew {r['skew']:.2f}); W13 ceiling TF/s: {ceil or c.get('error', '-')}")
        print(f"  {'side':<15} {'ms':>7} {'TF/s':>6} {'err out':>8}")
        for side, e in r["sides"].items():
            err = f"{e['rel_err_out_vs_baseline']:8.1e}" if "rel_err_out_vs_baseline" in e else f"{'-':>8}"
            print(f"  {side:<15} {e['ms']:7.3f} {e['tflops']:6.0f} {err}{'' if e.get('correct', True) else '  WRONG'}")
        for side, why in r["unavailable"].items():
            print(f"  {side:<15} unavailable: {why.splitlines()[0][:100]}")
        for fp8 in ("poise_fp8", "poise_fp8_prep", "poise_fp8_inf"):
            ratios = [f"{v:.2f}x {k.split('_vs_')[1]}" + (f" (goal {r['goals'][k]:g}x)" if k in r["goals"] else "")
                      for k, v in r["ratios"].items() if k.startswith(fp8 + "_vs_")]
            if ratios:
                print(f"  {fp8} faster than: {', '.join(ratios)}")


# ---------------------------------------------------------------- main
def run_case(name, skew_target, args):
    T, D, F, E, K = SHAPES[name]
    inputs, skew = make_inputs(T, D, F, E, K, skew_target)
    calls, contexts, unavailable = build_sides(name, inputs, args)
    errors = check_sides(calls, contexts, unavailable)
    print(f"{name} {routing_name(skew_target)} (skew {skew:.2f}): rel err out vs baseline "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
    ceiling_row = None if args.no_ceiling else ceiling(name, args)
    block_ms, spans = timed_blocks(calls, args)
    for side, ctx in contexts.items():
        if side in calls:
            ctx.check()  # a device fault would make the timings meaningless
        ctx.close()
    return case_record(name, skew_target, skew, block_ms, errors, unavailable, ceiling_row, args), spans


def main(argv=None):
    return run_benchmark(parse_args(argv), run_case, report, print_table)


if __name__ == "__main__":
    sys.exit(main())
