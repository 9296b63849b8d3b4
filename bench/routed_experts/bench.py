#!/usr/bin/env python3
"""The headline benchmark: poise.routed_experts against the eager PyTorch baseline, same inputs.

One EP rank's routed experts at the DeepSeek-V3 EP8 rank and Qwen3-30B-A3B shapes, balanced routing
and peak/mean ~3 rows per expert. Poise runs the product path (poise.routed_experts on a one-rank
context, autograd for backward, weights as nn.Parameter so weight grads are produced as a training
step pays); the baseline is sort-permute + torch._grouped_mm + SwiGLU + unpermute in eager PyTorch.
Both are timed forward (grad enabled, the graph dropped) and forward+backward, with CUDA events, in
blocks that alternate baseline and Poise so that the card's drift hits both alike.

Usage: python3 bench/routed_experts/bench.py [--out FILE] [--commit SHA] [--shapes ...] [--skews 1,3]
Needs an SM90 GPU and the poise module built (pip install .). About two minutes on an H200.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as Fn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/: the clock sampler, the commit
from provenance import commit_of  # noqa: E402
from smi_sampler import SmiSampler, device_identity, median_clock_power  # noqa: E402
from timing import time_block  # noqa: E402

SHAPES = {
    # name: (T, D, F, E_local, K)
    "deepseek_v3_ep8_rank": (4096, 7168, 2048, 32, 8),
    "qwen3_30b_a3b": (8192, 2048, 768, 128, 8),
}
DEFAULT_OUT = "bench/results/routed_experts_h200.json"
# bf16 outputs of two different summation orders differ by ~6e-3 relative (the old bench's records).
TOLERANCE = 2e-2
SIDES = ("baseline", "poise")
MODES = ("fwd", "fwdbwd")


# ---------------------------------------------------------------- arguments
def case_arguments(default_out, default_skews):
    """The arguments every case bench takes (this one, bench/fp8_forward): output, commit, shapes,
    skews and block timing; parse_case_arguments checks them."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=default_out, help=f"JSON results (default {default_out})")
    ap.add_argument("--commit", default=None, help="recorded commit (default: $POISE_COMMIT, else git)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument("--skews", default=default_skews, help="target peak/mean rows per expert; <= 1: balanced")
    ap.add_argument("--blocks", type=int, default=5, help="timed blocks per side and mode (median recorded)")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per block (its median)")
    ap.add_argument("--settle-s", type=float, default=0.5, help="idle before each block")
    ap.add_argument("--warm-ms", type=float, default=200.0, help="warm-up before each block")
    return ap


def parse_case_arguments(ap, argv, positive=("blocks", "reps")):
    """ap's arguments parsed and checked: shapes known, skews numbers, `positive` ones >= 1."""
    args = ap.parse_args(argv)
    args.shapes = args.shapes.split(",")
    for name in args.shapes:
        if name not in SHAPES:
            ap.error(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPES)})")
    try:
        args.skews = [float(s) for s in args.skews.split(",")]
    except ValueError:
        ap.error(f"--skews must be comma-separated numbers, got {args.skews!r}")
    for name in positive:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.settle_s < 0 or args.warm_ms < 0:
        ap.error("--settle-s and --warm-ms must be >= 0")
    return args


def timing_record(args, method):
    """The report's "timing" entry: case_arguments' timing arguments and how the blocks were timed."""
    return {"blocks": args.blocks, "reps": args.reps, "settle_s": args.settle_s, "warm_ms": args.warm_ms,
            "method": method}


def parse_args(argv=None):
    return parse_case_arguments(case_arguments(DEFAULT_OUT, "1,3"), argv)


# ---------------------------------------------------------------- routing and inputs
def make_routing(T, E, K, target_skew, gen):
    """ids [T, K] int64 (distinct experts per token) on gen's device, with peak/mean rows per expert
    ~ target_skew (<= 1: uniform), and the peak/mean reached. Experts are drawn without replacement
    with weights (rank + 1)^-s over a random order of the experts; s is bisected to the target."""
    dev = gen.device

    def sample(s):
        w = (torch.arange(E, device=dev, dtype=torch.float64) + 1.0) ** (-s)
        w = w[torch.randperm(E, device=dev, generator=gen)]
        ids = torch.multinomial(w.float().expand(T, E), K, replacement=False, generator=gen)
        counts = torch.bincount(ids.flatten(), minlength=E).double()
        return ids, (counts.max() / counts.mean()).item()

    best = sample(0.0)
    if target_skew <= 1.0:
        return best
    lo, hi = 0.0, 4.0
    for _ in range(14):
        mid = 0.5 * (lo + hi)
        ids, skew = sample(mid)
        if abs(skew - target_skew) < abs(best[1] - target_skew):
            best = (ids, skew)
        if skew < target_skew:
            lo = mid
        else:
            hi = mid
    return best


def routing_name(target_skew):
    return "balanced" if target_skew <= 1 else f"peak/mean~{target_skew:g}"


def make_inputs(T, D, F, E, K, skew_target, device="cuda"):
    """Seeded random inputs of one case: the leaves both sides differentiate (x, scores, w13, w2),
    ids (int64 for the baseline, int32 for Poise), grad_out, and the routing's peak/mean."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    ids_TK, skew = make_routing(T, E, K, skew_target, gen)
    bf = torch.bfloat16

    def normal(*shape, std=1.0, dtype=bf):
        return (torch.randn(*shape, device=device, generator=gen) * std).to(dtype)

    return {
        "x_TD": normal(T, D).requires_grad_(True),
        "scores_TK": torch.softmax(normal(T, K, dtype=torch.float32), dim=-1).requires_grad_(True),
        "w13_E2FD": torch.nn.Parameter(normal(E, 2 * F, D, std=1 / math.sqrt(D))),
        "w2_EDF": torch.nn.Parameter(normal(E, D, F, std=1 / math.sqrt(F))),
        "ids_TK": ids_TK,
        "ids32_TK": ids_TK.to(torch.int32).contiguous(),
        "grad_out_TD": normal(T, D),
    }, skew


LEAVES = ("x_TD", "scores_TK", "w13_E2FD", "w2_EDF")


# ---------------------------------------------------------------- the two sides
def baseline_forward(x_TD, ids_TK, scores_TK, w13_E2FD, w2_EDF):
    """Eager PyTorch: sort-permute + _grouped_mm + SwiGLU + _grouped_mm + score multiply + index_add_."""
    T, K = ids_TK.shape
    E = w13_E2FD.shape[0]
    flat = ids_TK.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0, dtype=torch.int32)
    tok = order // K
    xs = x_TD.index_select(0, tok)
    h = torch._grouped_mm(xs, w13_E2FD.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    a = Fn.silu(g) * u
    y = torch._grouped_mm(a, w2_EDF.transpose(1, 2), offs=offs)
    y = y * scores_TK.flatten().index_select(0, order).unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x_TD).index_add_(0, tok, y)


def poise_config(T, D, F, E, K):
    """One rank, capacity balance with factor 1: a single rank receives exactly its own T*K rows
    whatever the skew, so every routing fits, without the exact-balance planner's work."""
    import poise

    return poise.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, num_experts=E, top_k=K,
                        balance="capacity", receive_capacity_factor=1.0)


def side_calls(inputs, context):
    """{side: forward()} on the same leaves: the baseline on int64 ids, Poise on int32 ids."""
    import poise

    x, s, w13, w2 = (inputs[n] for n in LEAVES)
    return {
        "baseline": lambda: baseline_forward(x, inputs["ids_TK"], s, w13, w2),
        "poise": lambda: poise.routed_experts(x, inputs["ids32_TK"], s, w13, w2, context),
    }


def training_step(forward, inputs):
    """forward+backward as a training step pays it: grads set to None first (zero_grad), fresh
    autograd grads for x, scores, w13 and w2."""
    def step():
        for name in LEAVES:
            inputs[name].grad = None
        forward().backward(inputs["grad_out_TD"])
    return step


# ---------------------------------------------------------------- correctness
def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def outputs_and_grads(forward, inputs):
    for name in LEAVES:
        inputs[name].grad = None
    out = forward()
    out.backward(inputs["grad_out_TD"])
    got = {"out": out.detach(), "grad_x": inputs["x_TD"].grad, "grad_scores": inputs["scores_TK"].grad,
           "grad_w13": inputs["w13_E2FD"].grad, "grad_w2": inputs["w2_EDF"].grad}
    for name in LEAVES:
        inputs[name].grad = None
    return got


def check_case(calls, inputs):
    """Relative error of Poise against the baseline, output and every gradient (Poise runs first, on
    outputs autograd allocates fresh)."""
    got = outputs_and_grads(calls["poise"], inputs)
    want = outputs_and_grads(calls["baseline"], inputs)
    return {k: rel_err(got[k], want[k]) for k in got}


# ---------------------------------------------------------------- timing
def timed_blocks(steps, args):
    """{f"{side}_{mode}_ms": [block medians]} and the blocks' windows, each mode's sides alternated
    block by block (A/B/A/B)."""
    ms, spans = {}, {}
    for mode in MODES:
        for _ in range(args.blocks):
            for side in SIDES:
                key = f"{side}_{mode}_ms"
                block_ms, span = time_block(steps[side][mode], args.reps, args.settle_s, args.warm_ms)
                ms.setdefault(key, []).append(block_ms)
                spans.setdefault(key, []).append(span)
    return ms, spans


def block_clocks(smi, spans):
    """Each block's median SM clock (MHz) and instantaneous board power (W) over its timed window
    (None where no sample fell inside), the sample counts and the clock event reasons seen
    (0x...4: the software power cap)."""
    per_block = {k: [median_clock_power(smi.samples_between(a, b)) for a, b in v] for k, v in spans.items()}
    return {"block_sm_mhz": {k: [m and m[0] for m in v] for k, v in per_block.items()},
            "block_power_w": {k: [m and m[1] for m in v] for k, v in per_block.items()},
            "block_clock_samples": {k: [m[3] if m else 0 for m in v] for k, v in per_block.items()},
            "block_clock_reasons": {k: sorted({r for m in v if m for r in m[2]}) for k, v in per_block.items()}}


# ---------------------------------------------------------------- records
def case_record(name, skew_target, skew, block_ms, errors):
    """One case's JSON record from its block medians ({side_mode_ms: [ms per block]}) and errors."""
    T, D, F, E, K = SHAPES[name]
    flops_fwd = 6.0 * T * K * D * F  # W13 (2 x D x 2F) + W2 (2 x F x D) per routed row
    ms = {k: statistics.median(v) for k, v in block_ms.items()}
    rec = {"shape": name, "T": T, "D": D, "F": F, "E_local": E, "K": K,
           "routing": routing_name(skew_target), "skew": round(skew, 3)}
    for mode, flops in (("fwd", flops_fwd), ("fwdbwd", 3 * flops_fwd)):
        p, b = ms[f"poise_{mode}_ms"], ms[f"baseline_{mode}_ms"]
        rec.update({f"poise_{mode}_ms": p, f"baseline_{mode}_ms": b, f"speedup_{mode}": b / p,
                    f"poise_{mode}_tflops": flops / p / 1e9, f"baseline_{mode}_tflops": flops / b / 1e9})
    rec["rel_err_vs_baseline"] = errors
    rec["correct"] = all(v <= TOLERANCE for v in errors.values())
    rec["block_ms"] = block_ms
    return rec


def report(records, args, commit, device, started):
    return {"benchmark": "routed_experts", "commit": commit, "device": device, "torch": torch.__version__,
            "timing": timing_record(args, "CUDA events around each call from an idle GPU; per block the median of "
                                          "reps calls after settle_s idle and warm_ms of warm-up; baseline and "
                                          "Poise blocks alternated; records hold the median over blocks"),
            "config": {"ep_size": 1, "balance": "capacity", "receive_capacity_factor": 1.0,
                       "scores": "fp32", "weight_grads": "bf16 (autograd, nn.Parameter)"},
            "tolerance": TOLERANCE, "seconds": round(time.perf_counter() - started, 1), "cases": records}


def write_report(path, rep):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=1) + "\n")


def print_table(records):
    print(f"\n{'shape':<21} {'routing':<12} {'skew':>5}  {'fwd ms (base)':>15} {'x':>5}  {'fwdbwd ms (base)':>17} "
          f"{'x':>5}  {'TF/s fwd':>8} {'fwdbwd':>6}  {'err out':>7} {'grad_x':>7}")
    for r in records:
        e = r["rel_err_vs_baseline"]
        print(f"{r['shape']:<21} {r['routing']:<12} {r['skew']:5.2f}  "
              f"{r['poise_fwd_ms']:6.2f} ({r['baseline_fwd_ms']:6.2f}) {r['speedup_fwd']:5.2f}  "
              f"{r['poise_fwdbwd_ms']:7.2f} ({r['baseline_fwdbwd_ms']:7.2f}) {r['speedup_fwdbwd']:5.2f}  "
              f"{r['poise_fwd_tflops']:8.0f} {r['poise_fwdbwd_tflops']:6.0f}  "
              f"{e['out']:7.1e} {e['grad_x']:7.1e}{'' if r['correct'] else '  WRONG'}")


# ---------------------------------------------------------------- main
def run_case(name, skew_target, args):
    import poise

    T, D, F, E, K = SHAPES[name]
    inputs, skew = make_inputs(T, D, F, E, K, skew_target)
    context = poise.create_context(config=poise_config(T, D, F, E, K), device="cuda")
    calls = side_calls(inputs, context)
    errors = check_case(calls, inputs)
    context.check()
    print(f"{name} {routing_name(skew_target)} (skew {skew:.2f}): rel err out {errors['out']:.1e}, "
          f"grad_x {errors['grad_x']:.1e}", flush=True)
    steps = {side: {"fwd": fwd, "fwdbwd": training_step(fwd, inputs)} for side, fwd in calls.items()}
    block_ms, spans = timed_blocks(steps, args)
    context.check()  # a device fault would make the timings meaningless
    context.close()
    return case_record(name, skew_target, skew, block_ms, errors), spans


def run_benchmark(args, run_case, report, print_table):
    """Every (shape, skew) case of args under one clock sampler: run_case(name, skew_target, args) ->
    (record, spans); report(records, args, commit, device, started) -> the JSON written to args.out
    after each case (a run cut short keeps its records) and at the end with each block's clocks.
    Returns the exit status: 0 when every record is correct. Shared with bench/fp8_forward."""
    started = time.perf_counter()
    commit = commit_of(args.commit)
    device = {"torch_name": torch.cuda.get_device_name(), **device_identity()}
    print(f"device: {device}\ncommit: {commit}", flush=True)
    records, spans = [], []
    with SmiSampler(period_ms=25) as smi:
        for name in args.shapes:
            for skew_target in args.skews:
                rec, case_spans = run_case(name, skew_target, args)
                records.append(rec)
                spans.append(case_spans)
                write_report(args.out, report(records, args, commit, device, started))
                torch.cuda.empty_cache()
    for rec, case_spans in zip(records, spans):  # the sampler has stopped: all its lines are in
        rec.update(block_clocks(smi, case_spans))
    write_report(args.out, report(records, args, commit, device, started))
    print_table(records)
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
    return 0 if all(r["correct"] for r in records) else 1


def main(argv=None):
    return run_benchmark(parse_args(argv), run_case, report, print_table)

if __name__ == "__main__":
    sys.exit(main())
