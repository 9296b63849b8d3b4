"""One Experts call at decode: host time per call of "poise" against transformers' "grouped_mm".

A Qwen3-MoE Experts module at Qwen3-30B-A3B's dimensions (D=2048, F=768, E=128, K=8, bf16, random
weights) called with 8 tokens under torch.no_grad(), as a decode step calls each MoE layer. Decode is
host-bound, so what a layer costs there is its host time per call: the calls are queued back to back
(--calls per round, --rounds rounds, implementations alternated) and timed on the host; "wall"
includes draining the device after the last call; "graph_gpu_us" is one call's device time alone
(a CUDA graph of it, replayed). Also the relative L2 distance of poise's output
from grouped_mm's (bf16: a few 1e-3).

  python3 bench/transformers/decode_call.py [--out bench/results/transformers_decode_call_h200.json]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
import transformers
from transformers.integrations.moe import ExpertsInterface
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/: provenance
import poise.integrations.transformers as poise_hf  # noqa: E402  registers "poise"
from provenance import commit_of, write_result  # noqa: E402

TOKENS = 8


def host_and_wall_us(fn, calls: int) -> dict[str, float]:
    for _ in range(calls // 10):  # warm-up
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return {"host_us": 1e6 * (queued - start) / calls, "wall_us": 1e6 * (done - start) / calls}


def graph_gpu_us(fn, replays: int = 50) -> float:
    """Device time of one call, from a CUDA graph of it replayed back to back (no host time in it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / replays


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/transformers_decode_call_h200.json")
    ap.add_argument("--commit", default=None, help="recorded commit (default: $POISE_COMMIT, else git)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    config = transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                         num_experts=128, num_experts_per_tok=8, num_hidden_layers=2,
                                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=1000)
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config).to("cuda", torch.bfloat16)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    experts, top_k = config.num_experts, config.num_experts_per_tok
    hidden = torch.randn(TOKENS, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    top_k_index = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(TOKENS)])
    top_k_weights = torch.softmax(torch.randn(TOKENS, top_k, device="cuda"), -1)
    implementations = {"grouped_mm": ExpertsInterface._global_mapping["grouped_mm"],
                       "poise": poise_hf.poise_experts_forward}
    rounds: dict[str, list] = {name: [] for name in implementations}
    with torch.no_grad():
        ref = implementations["grouped_mm"](module, hidden, top_k_index, top_k_weights.to(torch.bfloat16)).float()
        got = implementations["poise"](module, hidden, top_k_index, top_k_weights).float()
        rel_err = float((got - ref).norm() / ref.norm())
        for _ in range(args.rounds):
            for name, forward in implementations.items():
                rounds[name].append(host_and_wall_us(lambda f=forward: f(module, hidden, top_k_index, top_k_weights),
                                                     args.calls))
        graph_us = {name: graph_gpu_us(lambda f=forward: f(module, hidden, top_k_index, top_k_weights))
                    for name, forward in implementations.items()}
    summary = {name: {"host_us_median": statistics.median(r["host_us"] for r in rs), "graph_gpu_us": graph_us[name],
                      "rounds": rs} for name, rs in rounds.items()}
    result = {"benchmark": "transformers_decode_call", "commit": commit_of(args.commit),
              "device": torch.cuda.get_device_name(), "tokens": TOKENS, "calls": args.calls,
              "poise_rel_l2_vs_grouped_mm": rel_err, "results": summary,
              "grouped_mm_host_over_poise": summary["grouped_mm"]["host_us_median"] / summary["poise"]["host_us_median"]}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
