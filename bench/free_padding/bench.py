#!/usr/bin/env python3
"""Free padding: what a call pays for rows whose expert ids are -1 (issue 36).

A context sized for --tokens (8192) serving --real (1024) tokens, the rest padding, against a
context sized for the real tokens, same real inputs, through poise.routed_experts on one GPU:
  - "exact":     a context of --real tokens, no padding
  - "free":      a context of --tokens, padding rows with ids -1 (zero x, zero scores)
  - "zero_score": the same, padding rows routed (ids of the real tokens in turn) with zero scores:
                 what padding cost before ids of -1 (every padding row computed)
Forward under no_grad on inference contexts, and forward+backward on training contexts. Shape:
Qwen3-30B-A3B's experts (D=2048, F=768, E=128, K=8). Medians of --reps calls per block, blocks of
the three sides alternated (bench/timing.py's time_block). The padded sides' real
rows are checked against "exact" (out and grad_x relative error).

Usage: python3 bench/free_padding/bench.py [--out FILE] [--tokens 8192] [--real 1024] [--blocks 3]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

import poise

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: provenance, device identity
from provenance import commit_of  # noqa: E402
from smi_sampler import device_identity  # noqa: E402
from timing import time_block  # noqa: E402

DEFAULT_OUT = "bench/results/free_padding_h200.json"
D, F, E, K = 2048, 768, 128, 8
SIDES = ("exact", "free", "zero_score")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--tokens", type=int, default=8192, help="the padded context's tokens")
    ap.add_argument("--real", type=int, default=1024, help="real tokens per call")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--settle-s", type=float, default=0.3)
    ap.add_argument("--warm-ms", type=float, default=100.0)
    args = ap.parse_args(argv)
    if not 0 < args.real <= args.tokens:
        ap.error(f"need 0 < --real <= --tokens, got {args.real} and {args.tokens}")
    return args


def real_inputs(n: int):
    gen = torch.Generator(device="cuda").manual_seed(36)

    def normal(*shape, std=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * std).to(torch.bfloat16)

    ids = torch.rand(n, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int32)
    return {"x_TD": normal(n, D), "ids_TK": ids,
            "scores_TK": torch.softmax(torch.randn(n, K, device="cuda", generator=gen), dim=-1),
            "w13": normal(E, 2 * F, D, std=D**-0.5), "w2": normal(E, D, F, std=F**-0.5),
            "grad_out_TD": normal(n, D)}


def padded(real, tokens: int, side: str):
    """The call's tensors for a side: the real rows, then padding up to `tokens`."""
    n = real["x_TD"].shape[0]
    pad = tokens - n
    if side == "exact" or pad == 0:
        return real["x_TD"], real["ids_TK"], real["scores_TK"], real["grad_out_TD"]
    pad_ids = (torch.full((pad, K), -1, dtype=torch.int32, device="cuda") if side == "free"
               else real["ids_TK"][torch.arange(pad, device="cuda") % n])
    zeros = real["x_TD"].new_zeros(pad, D)
    return (torch.cat([real["x_TD"], zeros]), torch.cat([real["ids_TK"], pad_ids]),
            torch.cat([real["scores_TK"], real["scores_TK"].new_zeros(pad, K)]), torch.cat([real["grad_out_TD"], zeros]))


def side_steps(real, args):
    """{side: {"forward": fn, "forward_backward": fn}} and each side's first-call results."""
    steps, results = {}, {}
    for side in SIDES:
        tokens = real["x_TD"].shape[0] if side == "exact" else args.tokens
        x, ids, scores, grad_out = padded(real, tokens, side)
        x = x.detach().requires_grad_(True)
        w13, w2 = (torch.nn.Parameter(real[n].clone()) for n in ("w13", "w2"))
        config = dict(num_local_input_tokens=tokens, hidden_dim=D, intermediate_dim=F, num_experts=E, top_k=K,
                      balance="capacity", receive_capacity_factor=1.0)
        inference = poise.create_context(config=poise.Config(**config, inference=True), device="cuda")
        training = poise.create_context(config=poise.Config(**config), device="cuda")

        def forward(x=x, ids=ids, scores=scores, w13=w13, w2=w2, context=inference):
            with torch.no_grad():
                return poise.routed_experts(x, ids, scores, w13, w2, context)

        def forward_backward(x=x, ids=ids, scores=scores, w13=w13, w2=w2, context=training, grad_out=grad_out):
            for t in (x, w13, w2):
                t.grad = None
            out = poise.routed_experts(x, ids, scores, w13, w2, context)
            out.backward(grad_out)
            return out

        n = real["x_TD"].shape[0]
        out = forward_backward()
        results[side] = {"out": out.detach()[:n].clone(), "grad_x": x.grad[:n].clone(),
                         "inference_out": forward()[:n].clone()}
        steps[side] = {"forward": forward, "forward_backward": forward_backward}
    return steps, results


def errors_against_exact(results):
    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    want = results["exact"]
    return {side: {k: rel(results[side][k], want[k]) for k in want} for side in SIDES if side != "exact"}


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    real = real_inputs(args.real)
    steps, results = side_steps(real, args)
    errors = errors_against_exact(results)
    ms = {}
    for mode in ("forward", "forward_backward"):
        for _ in range(args.blocks):
            for side in SIDES:
                block_ms, _ = time_block(steps[side][mode], args.reps, args.settle_s, args.warm_ms)
                ms.setdefault(f"{side}_{mode}_ms", []).append(block_ms)
    medians = {key: statistics.median(v) for key, v in ms.items()}
    ratios = {f"{side}_over_exact_{mode}": medians[f"{side}_{mode}_ms"] / medians[f"exact_{mode}_ms"]
              for side in ("free", "zero_score") for mode in ("forward", "forward_backward")}
    result = {"benchmark": "free_padding", "commit": commit_of(args.commit),
              "device": {"torch_name": torch.cuda.get_device_name(), **device_identity()},
              "shape": {"D": D, "F": F, "E": E, "K": K}, "tokens": args.tokens, "real_tokens": args.real,
              "reps": args.reps, "blocks": args.blocks, "block_ms": ms, "median_ms": medians, "ratios": ratios,
              "errors_vs_exact": errors, "torch": torch.__version__, "seconds": time.perf_counter() - started}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for key, value in {**medians, **ratios}.items():
        print(f"{key:40s} {value:8.3f}")
    print("errors vs exact:", json.dumps(errors))
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
