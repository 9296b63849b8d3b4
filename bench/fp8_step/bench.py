#!/usr/bin/env python3
"""The FP8 training step of issue 41: forward+backward, Poise FP8 vs Poise BF16, eager PyTorch FP8 and
the eager BF16 baseline.

Through the public Python API and autograd, one EP rank's routed experts at the shapes of
bench/routed_experts/bench.py (DeepSeek-V3 EP8 rank, Qwen3-30B-A3B), the same seeded inputs for every
side; each step sets the grads to None, runs the forward and backward (grads of x, scores, w13 and w2).
Sides:
  baseline        bench/routed_experts/bench.py's baseline_forward under autograd (BF16)
  peer_fp8        eager FP8 as a PyTorch user builds it on torch._scaled_grouped_mm (rowwise scales,
                  the recipe of torchao's FP8 MoE training for the GEMMs torch has): the forward of
                  bench/fp8_forward (weights quantized inside the step, as BF16 master weights change
                  every step), DGRAD of W2 and W13 in FP8 (gradient rows rowwise, the weights' transposed
                  copies rowwise), WGRAD in BF16 (torch._grouped_mm with the groups along K)
  poise_bf16      poise.routed_experts on a one-rank BF16 context
  poise_fp8       the same with gemm_precision='fp8_block_scaled': FPROP and DGRAD in FP8, WGRAD in BF16
                  (the default, fp8_wgrad=False), the weights quantized inside the call (forward blocks and
                  backward transposed copies)
  poise_fp8_prep  poise_fp8 with prepared weights (poise.prepare_weights(..., transposed=True) outside the
                  timing, as with many micro-batches per optimizer step): the forward's blocks and the
                  backward's transposed copies, so no weight is quantized in the step
  poise_fp8_w8    poise_fp8 with fp8_wgrad=True: WGRAD in FP8 too (DeepSeek-V3's recipe)
Every side's blocks alternate (bench/timing.py's time_block). Also recorded: each side's out and grads
against the baseline's (relative L2; weights per expert, the worst), each side's TFLOP/s (3 x the
forward's 6 T K D F).

Usage: python3 bench/fp8_step/bench.py [--out FILE] [--commit SHA] [--shapes ...] [--skews 1,3]
Needs an SM90 GPU and the poise module built (pip install .).
"""
from __future__ import annotations

import pathlib
import sys
import time

import torch
import torch.nn.functional as Fn

BENCH = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from fp8_forward.bench import (  # noqa: E402
    PEER_ROW_ALIGN, gather_rows_fp8, poise_sides_ran_and_correct, quantize_rows, run_checked, timed_blocks,
    timed_entries)
from routed_experts.bench import (  # noqa: E402
    LEAVES, SHAPES, TOLERANCE as BF16_TOLERANCE, baseline_forward, case_arguments, make_inputs,
    outputs_and_grads, parse_case_arguments, poise_config, rel_err, routing_name, run_benchmark, timing_record,
    training_step)

DEFAULT_OUT = "bench/results/fp8_step_h200.json"
# FP8 against the BF16 baseline (docs/fp8.md: 6-8% from float64 on one expert group for y and every
# gradient); a broken kernel or a wrong scale is far beyond.
FP8_TOLERANCE = 0.15
SIDES = ("baseline", "peer_fp8", "poise_bf16", "poise_fp8", "poise_fp8_prep", "poise_fp8_w8")
FP8_SIDES = ("peer_fp8", "poise_fp8", "poise_fp8_prep", "poise_fp8_w8")
RATIOS = (("poise_fp8", "poise_bf16"), ("poise_fp8", "peer_fp8"), ("poise_fp8", "baseline"),
          ("poise_fp8_prep", "poise_bf16"), ("poise_fp8_prep", "peer_fp8"), ("poise_fp8_w8", "poise_bf16"),
          ("poise_bf16", "baseline"))
GOALS = {("deepseek_v3_ep8_rank", "poise_fp8_vs_poise_bf16"): 1.5,  # issue 41
         ("qwen3_30b_a3b", "poise_fp8_vs_poise_bf16"): 1.3}
OUTPUTS = ("out", "grad_x", "grad_scores", "grad_w13", "grad_w2")


def parse_args(argv=None):
    ap = case_arguments(DEFAULT_OUT, "1")
    ap.description = __doc__.split("\n")[0]
    ap.add_argument("--peer-align", type=int, default=PEER_ROW_ALIGN,
                    help=f"peer_fp8: rows per expert padded to a multiple of this (default {PEER_ROW_ALIGN})")
    return parse_case_arguments(ap, argv, positive=("blocks", "reps", "peer_align"))


# ---------------------------------------------------------------- peer_fp8: eager PyTorch FP8 training
def padded_routing(ids_TK, E, align):
    """Sort-permute with each expert's rows padded to a multiple of align, in static shapes (no host
    sync): src_P (the token of each padded row; padding rows read token 0), slot_P (the (token, k)
    index of each padded row, T*K for padding), valid_P (real rows), offs (int32 group ends)."""
    T, K = ids_TK.shape
    flat = ids_TK.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + (align - 1)) // align * align
    ends = torch.cumsum(padded, 0)
    expert = flat.index_select(0, order)
    starts = torch.cumsum(counts, 0) - counts
    dest = torch.arange(T * K, device=flat.device) - starts.index_select(0, expert) \
        + (ends - padded).index_select(0, expert)
    P = T * K + E * (align - 1)
    slot_P = torch.full((P,), T * K, dtype=torch.int64, device=flat.device).index_copy_(0, dest, order)
    valid_P = slot_P < T * K
    src_P = torch.where(valid_P, slot_P // K, 0)
    return src_P, slot_P, valid_P, ends.to(torch.int32)


def quantized_weights(w13_E2FD, w2_EDF, transposed):
    """Rowwise E4M3 of each expert's weights along the GEMM's K: per output channel for the forward
    (K = D for W13, F for W2), per input channel of the transposed copies for DGRAD (K = 2F, D)."""
    if transposed:
        w13_q, s13 = quantize_rows(w13_E2FD.transpose(1, 2).contiguous())  # [E, D, 2F]
        w2_q, s2 = quantize_rows(w2_EDF.transpose(1, 2).contiguous())  # [E, F, D]
    else:
        w13_q, s13 = quantize_rows(w13_E2FD)  # [E, 2F, D]
        w2_q, s2 = quantize_rows(w2_EDF)  # [E, D, F]
    return w13_q, s13, w2_q, s2


def scaled_grouped(rows_bf16, w_q, w_s, offs):
    """rows [P, K] (bf16) quantized rowwise, times each group's w_q [E, N, K]^T in FP8, bf16 out."""
    q, s = quantize_rows(rows_bf16)
    return torch._scaled_grouped_mm(q, w_q.transpose(1, 2), s, w_s, offs=offs, out_dtype=torch.bfloat16)


class PeerFp8Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_TK, w13_E2FD, w2_EDF, ids_TK, align):
        T, K = ids_TK.shape
        E = w13_E2FD.shape[0]
        src_P, slot_P, valid_P, offs = padded_routing(ids_TK, E, align)
        score_P = torch.cat([scores_TK.flatten(), scores_TK.new_zeros(1)]).index_select(0, slot_P)
        x_q, x_s = quantize_rows(x_TD)  # per token: the same bits as per routed row
        w13_q, s13, w2_q, s2 = quantized_weights(w13_E2FD, w2_EDF, transposed=False)
        h_P2F = torch._scaled_grouped_mm(gather_rows_fp8(x_q, src_P), w13_q.transpose(1, 2), x_s.index_select(0, src_P),
                                         s13, offs=offs, out_dtype=torch.bfloat16)
        g, u = h_P2F.chunk(2, dim=-1)
        a_PF = Fn.silu(g) * u
        y_PD = scaled_grouped(a_PF, w2_q, s2, offs)
        # rows past the last group are not written by the GEMMs: masked, as padding rows (score 0)
        y_PD = torch.where(valid_P.unsqueeze(1), y_PD, 0)
        out_TD = torch.zeros_like(x_TD).index_add_(0, src_P, y_PD * score_P.unsqueeze(1).to(y_PD.dtype))
        ctx.save_for_backward(x_TD, w13_E2FD, w2_EDF, src_P, slot_P, valid_P, offs, score_P, h_P2F, y_PD)
        ctx.T, ctx.K = T, K
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, w13_E2FD, w2_EDF, src_P, slot_P, valid_P, offs, score_P, h_P2F, y_PD = ctx.saved_tensors
        w13t_q, s13t, w2t_q, s2t = quantized_weights(w13_E2FD, w2_EDF, transposed=True)
        gy_PD = torch.where(valid_P.unsqueeze(1), grad_out_TD.index_select(0, src_P), 0)
        grad_score_P = (gy_PD.float() * y_PD.float()).sum(dim=1)
        gy_PD = gy_PD * score_P.unsqueeze(1).to(gy_PD.dtype)
        g, u = h_P2F.chunk(2, dim=-1)
        with torch.enable_grad():  # SwiGLU's backward through autograd, in bf16 as the forward ran it
            g, u = g.detach().requires_grad_(), u.detach().requires_grad_()
            a_PF = Fn.silu(g) * u
            grad_a_PF = torch.where(valid_P.unsqueeze(1), scaled_grouped(gy_PD, w2t_q, s2t, offs), 0)
            grad_g, grad_u = torch.autograd.grad(a_PF, (g, u), grad_a_PF)
        grad_h_P2F = torch.cat([grad_g, grad_u], dim=1)
        grad_xs_PD = torch.where(valid_P.unsqueeze(1), scaled_grouped(grad_h_P2F, w13t_q, s13t, offs), 0)
        grad_x_TD = torch.zeros_like(x_TD).index_add_(0, src_P, grad_xs_PD)
        xs_PD = torch.where(valid_P.unsqueeze(1), x_TD.index_select(0, src_P), 0)
        grad_w2 = torch._grouped_mm(gy_PD.t(), a_PF.detach(), offs=offs)  # [E, D, F]
        grad_w13 = torch._grouped_mm(grad_h_P2F.t(), xs_PD, offs=offs)  # [E, 2F, D]
        T, K = ctx.T, ctx.K
        grad_scores = torch.zeros(T * K + 1, device=grad_out_TD.device).index_copy_(0, slot_P, grad_score_P)
        return grad_x_TD, grad_scores[:T * K].view(T, K), grad_w13, grad_w2, None, None


# ---------------------------------------------------------------- the sides
def build_sides(name, inputs, args):
    """({side: forward()}, {poise side: its context}, {side: why it is unavailable})."""
    import dataclasses

    import poise

    T, D, F, E, K = SHAPES[name]
    x, s, w13, w2 = (inputs[n] for n in LEAVES)
    calls, contexts, unavailable = {}, {}, {}
    for side in SIDES:
        try:
            if side == "baseline":
                calls[side] = lambda: baseline_forward(x, inputs["ids_TK"], s, w13, w2)
            elif side == "peer_fp8":
                if not hasattr(torch, "_scaled_grouped_mm"):
                    raise NotImplementedError(f"torch {torch.__version__} has no torch._scaled_grouped_mm")
                calls[side] = lambda: PeerFp8Experts.apply(x, s, w13, w2, inputs["ids_TK"], args.peer_align)
            else:
                config = dataclasses.replace(poise_config(T, D, F, E, K),
                                             gemm_precision="bf16" if side == "poise_bf16" else "fp8_block_scaled",
                                             fp8_wgrad=side == "poise_fp8_w8")
                ctx = contexts[side] = poise.create_context(config=config, device="cuda")
                prepared = (poise.prepare_weights(w13.detach(), w2.detach(), transposed=True)
                            if side == "poise_fp8_prep" else None)
                calls[side] = lambda ctx=ctx, prepared=prepared: poise.routed_experts(
                    x, inputs["ids32_TK"], s, w13, w2, ctx, prepared=prepared)
        except Exception as e:  # noqa: BLE001  recorded, the rest goes on
            unavailable[side] = f"{type(e).__name__}: {e}"
            print(f"{side} unavailable: {unavailable[side]}", flush=True)
    return calls, contexts, unavailable


def worst_expert(got, want):
    return max(rel_err(g, w) for g, w in zip(got, want))


def check_sides(calls, contexts, unavailable, inputs):
    """{side: {output: relative L2 against the baseline's}} (weight grads: the worst expert's); a side
    whose step raises moves to unavailable. Also poise_fp8_prep against poise_fp8 (the same bits
    expected: the prepared weights are the call's own quantization)."""
    want = outputs_and_grads(calls["baseline"], inputs)
    errors, got_of = {}, {}
    for side in [s for s in calls if s != "baseline"]:
        got = run_checked(side, lambda side=side: outputs_and_grads(calls[side], inputs), calls, contexts, unavailable)
        if got is None:
            continue
        got_of[side] = got
        errors[side] = {k: (worst_expert if k in ("grad_w13", "grad_w2") else rel_err)(got[k], want[k])
                        for k in OUTPUTS}
    same = None
    if "poise_fp8" in got_of and "poise_fp8_prep" in got_of:
        same = all(torch.equal(got_of["poise_fp8"][k], got_of["poise_fp8_prep"][k]) for k in OUTPUTS)
    return errors, same


def tolerance(side):
    return FP8_TOLERANCE if side in FP8_SIDES else BF16_TOLERANCE


# ---------------------------------------------------------------- records
def case_record(name, skew_target, skew, block_ms, errors, prep_same_bits, unavailable):
    T, D, F, E, K = SHAPES[name]
    flops = 3 * 6.0 * T * K * D * F  # forward W13 + W2, and twice that backward (DGRAD + WGRAD)
    rec = {"shape": name, "T": T, "D": D, "F": F, "E_local": E, "K": K, "routing": routing_name(skew_target),
           "skew": round(skew, 3), "flops_fwdbwd": flops, "sides": timed_entries(block_ms, SIDES, flops),
           "unavailable": unavailable}
    for side, entry in rec["sides"].items():
        if side != "baseline":
            entry.update(rel_err_vs_baseline=errors[side], tolerance=tolerance(side),
                         correct=all(v < tolerance(side) for v in errors[side].values()))
    rec["poise_fp8_prep_same_bits_as_poise_fp8"] = prep_same_bits
    rec["ratios"] = {f"{a}_vs_{b}": rec["sides"][b]["ms"] / rec["sides"][a]["ms"]
                     for a, b in RATIOS if a in rec["sides"] and b in rec["sides"]}
    rec["goals"] = {k: v for (shape, k), v in GOALS.items() if shape == name}
    rec["correct"] = poise_sides_ran_and_correct(rec, SIDES) and prep_same_bits is not False
    return rec


def report(records, args, commit, device, started):
    return {"benchmark": "fp8_step", "commit": commit, "device": device, "torch": torch.__version__,
            "timing": timing_record(args, "forward+backward (grads set to None, autograd grads of x, scores, w13, "
                                          "w2); CUDA events around each step from an idle GPU; per block the median "
                                          "of reps steps; the sides' blocks alternated; records hold the median over "
                                          "blocks"),
            "sides": dict(zip(SIDES, [
                "eager BF16 sort-permute + torch._grouped_mm + SwiGLU + torch._grouped_mm + scores + index_add_, "
                "autograd",
                "eager FP8: rowwise torch._scaled_grouped_mm forward and DGRAD (weights and transposed copies "
                "quantized in the step), BF16 torch._grouped_mm WGRAD; rows padded to peer_align per expert",
                "poise.routed_experts, one-rank BF16 context",
                "the same with gemm_precision='fp8_block_scaled', WGRAD in BF16 (weights quantized in the call)",
                "poise_fp8 with weights prepared once (both orientations), untimed",
                "poise_fp8 with fp8_wgrad=True (WGRAD in FP8 too)"])),
            "config": {"ep_size": 1, "balance": "capacity", "receive_capacity_factor": 1.0, "scores": "fp32",
                       "peer_align": args.peer_align},
            "tolerance": {"bf16": BF16_TOLERANCE, "fp8": FP8_TOLERANCE},
            "ratios": "the second side's ms / the first side's ms (> 1: the first is faster)",
            "seconds": round(time.perf_counter() - started, 1), "cases": records}


def print_table(records):
    for r in records:
        print(f"\n{r['shape']} {r['routing']} (skew {r['skew']:.2f}), forward+backward")
        print(f"  {'side':<15} {'ms':>7} {'TF/s':>6}  " + " ".join(f"{k:>11}" for k in OUTPUTS))
        for side, e in r["sides"].items():
            errs = " ".join(f"{e['rel_err_vs_baseline'][k]:11.1e}" for k in OUTPUTS) if "rel_err_vs_baseline" in e else ""
            print(f"  {side:<15} {e['ms']:7.2f} {e['tflops']:6.0f}  {errs}{'' if e.get('correct', True) else '  WRONG'}")
        for side, why in r["unavailable"].items():
            print(f"  {side:<15} unavailable: {why.splitlines()[0][:100]}")
        print("  " + ", ".join(f"{k} {v:.2f}x" + (f" (goal {r['goals'][k]:g}x)" if k in r["goals"] else "")
                               for k, v in r["ratios"].items()))


def run_case(name, skew_target, args):
    T, D, F, E, K = SHAPES[name]
    inputs, skew = make_inputs(T, D, F, E, K, skew_target)
    calls, contexts, unavailable = build_sides(name, inputs, args)
    errors, same = check_sides(calls, contexts, unavailable, inputs)
    print(f"{name} {routing_name(skew_target)} (skew {skew:.2f}): out / grad_x rel err vs baseline "
          + ", ".join(f"{s} {e['out']:.1e} / {e['grad_x']:.1e}" for s, e in errors.items()), flush=True)
    steps = {side: training_step(fwd, inputs) for side, fwd in calls.items()}
    block_ms, spans = timed_blocks(steps, args)
    for side, ctx in contexts.items():
        if side in calls:
            ctx.check()  # a device fault would make the timings meaningless
        ctx.close()
    return case_record(name, skew_target, skew, block_ms, errors, same, unavailable), spans


def main(argv=None):
    return run_benchmark(parse_args(argv), run_case, report, print_table)


if __name__ == "__main__":
    sys.exit(main())
