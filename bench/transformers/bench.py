#!/usr/bin/env python3
"""Poise inside a Hugging Face model: training step and generation with experts_implementation
"poise" against transformers' "grouped_mm" and "eager", same model, same inputs, one process.

The model (--family), with --layers decoder layers, random weights (bf16), random token ids:
- qwen3_moe (default): a Qwen3-MoE decoder at Qwen3-30B-A3B's dimensions (D=2048, F=768, E=128, K=8,
  32 heads, 4 KV heads, vocab 151936) -> bench/results/transformers_h200.json.
- gpt_oss: a gpt-oss decoder at gpt-oss-20b's dimensions (D=2880, F=2880, E=32, K=4, 64 heads of 64,
  8 KV heads, vocab 201088, sliding and full attention layers alternating, attention sinks): experts
  with biases, gate and up interleaved, weights stored transposed (gate_up_proj [E, D, 2F],
  down_proj [E, F, D]) and the clamped SwiGLU; Poise runs them on the weights as stored
  -> bench/results/transformers_gpt_oss_h200.json. transformers runs gpt-oss's attention eagerly (its
  sinks have no SDPA path), so the rest of the model weighs more than in Qwen3-MoE.
- Training: forward with labels + backward (no optimizer: it does not depend on the experts
  implementation), batch x seq tokens. Step time, tokens/s, peak memory.
- The MoE blocks' share: the same step with "zero" experts (a bench-only implementation returning
  hidden_states * 0, which keeps the router in the graph) times the rest of the model; an
  implementation's MoE time is its step time minus that.
- Generation: greedy prefill of batch x seq tokens, then --decode-steps steps of batch tokens; the
  decode time per step is (generate(decode-steps) - generate(1)) / (decode-steps - 1).
Timings are medians of --reps, alternating implementations so that the card's drift hits all alike;
the training steps are timed first, then the generations.

Usage: python3 bench/transformers/bench.py [--family qwen3_moe|gpt_oss] [--out FILE]
  [--implementations poise,grouped_mm,eager] [--layers 2] [--batch 8] [--seq 1024] [--decode-steps 64]
  [--reps 5] [--tiny --device cpu]
--tiny: a model of the family's structure at tiny dims, for a smoke test on the CPU (tests/python).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
import transformers
from transformers.integrations.moe import ExpertsInterface

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/: provenance, device identity
import poise.integrations.transformers as poise_hf  # noqa: E402  registers "poise"
from provenance import commit_of  # noqa: E402
from smi_sampler import device_identity  # noqa: E402

IMPLEMENTATIONS = ("poise", "grouped_mm", "eager")
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
# gpt-oss-20b's config.json; the rest (yarn RoPE of factor 32 over 4096 positions, sliding window 128 on
# every other layer, swiglu_alpha 1.702, swiglu_limit 7.0, attention biases) is GptOssConfig's default.
GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                   num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64)
TINY_GPT_OSS = dict(vocab_size=512, hidden_size=128, intermediate_size=64, num_local_experts=8, num_experts_per_tok=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32)
FAMILIES = {  # name: (config class, dims, tiny dims, default --out)
    "qwen3_moe": (transformers.Qwen3MoeConfig, QWEN3_30B_A3B, TINY, "bench/results/transformers_h200.json"),
    "gpt_oss": (transformers.GptOssConfig, GPT_OSS_20B, TINY_GPT_OSS, "bench/results/transformers_gpt_oss_h200.json"),
}
DEFAULT_OUT = FAMILIES["qwen3_moe"][3]


def zero_experts(module, hidden_states, top_k_index, top_k_weights):
    """The rest of the model's cost: no expert work, the router's weights still in the graph."""
    return hidden_states * 0 + top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype) * 0


ExpertsInterface.register("zero", zero_experts)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILIES),
                    help="the model: qwen3_moe (Qwen3-30B-A3B dims, default) or gpt_oss (gpt-oss-20b dims)")
    ap.add_argument("--out", default=None, help=f"JSON results (default {DEFAULT_OUT}; gpt_oss: "
                                                f"{FAMILIES['gpt_oss'][3]})")
    ap.add_argument("--commit", default=None, help="recorded commit (default: $POISE_COMMIT, else git)")
    ap.add_argument("--implementations", default=",".join(IMPLEMENTATIONS),
                    help="comma-separated, of: " + ", ".join(IMPLEMENTATIONS))
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (each with an MoE block)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (training, and the prompt)")
    ap.add_argument("--decode-steps", type=int, default=64, help="generated tokens per sequence (>= 2)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per implementation (median)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (a smoke test, e.g. on the CPU)")
    args = ap.parse_args(argv)
    args.implementations = args.implementations.split(",")
    if args.out is None:
        args.out = FAMILIES[args.family][3]
    for name in args.implementations:
        if name not in IMPLEMENTATIONS:
            ap.error(f"--implementations: unknown {name!r} (known: {', '.join(IMPLEMENTATIONS)})")
    for name in ("layers", "batch", "seq", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.decode_steps < 2:
        ap.error(f"--decode-steps must be at least 2, got {args.decode_steps}")
    return args


def build_model(args):
    config_class, dims, tiny_dims, _ = FAMILIES[args.family]
    dims = tiny_dims if args.tiny else dims
    # gpt-oss keeps gpt-oss-20b's max_position_embeddings (131072), the context its yarn RoPE parameters describe.
    positions = {} if args.family == "gpt_oss" else dict(max_position_embeddings=args.seq + args.decode_steps + 8)
    config = config_class(**dims, num_hidden_layers=args.layers, **positions)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(args.device)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Seconds of one call of fn, the device drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def training_step(model, token_ids):
    model.zero_grad(set_to_none=True)
    model(token_ids, labels=token_ids).loss.backward()


def generation(model, prompt, new_tokens: int):
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0)


def peak_memory_of(fn, device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def measure(model, args) -> dict[str, dict]:
    """Median times per implementation (and "zero"), repetitions interleaved across implementations."""
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    token_ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(args.device)
    names = [*args.implementations, "zero"]
    jobs = {
        "train_s": lambda: training_step(model, token_ids),
        "prefill_s": lambda: generation(model, token_ids, 1),
        "generate_s": lambda: generation(model, token_ids, args.decode_steps),
    }
    samples = {name: {job: [] for job in jobs} for name in names}
    peak = {}
    for name in names:  # warm-up: contexts, allocator, kernels; and the training step's peak memory
        model.set_experts_implementation(name)
        for job in jobs.values():
            job()
        peak[name] = peak_memory_of(jobs["train_s"], args.device)
    # Training, then generation, each its own phase, as a user runs them: each generate() timed right
    # after a training step measured poise's decode 0.85-0.99x grouped_mm's (e55e237), generate()s
    # timed back to back (decode_trace.py) 1.04-1.22x.
    for phase in (("train_s",), ("prefill_s", "generate_s")):
        for _ in range(args.reps):
            for name in names:
                model.set_experts_implementation(name)
                for job in phase:
                    samples[name][job].append(timed(jobs[job], args.device))
    return {name: {**{job: statistics.median(v) for job, v in samples[name].items()},
                   "train_peak_bytes": peak[name], "samples": samples[name]} for name in names}


def decode_steps_per_rep(t: dict, args) -> list[float]:
    """Seconds per decode step in each repetition (its own generate and prefill)."""
    return [(g - p) / (args.decode_steps - 1) for g, p in zip(t["samples"]["generate_s"], t["samples"]["prefill_s"])]


def summarize(times: dict[str, dict], args) -> dict[str, dict]:
    """Per implementation: step and MoE times, tokens/s, decode per step; ratios against grouped_mm."""
    tokens = args.batch * args.seq
    rest = times["zero"]
    rows = {}
    for name in args.implementations:
        t = times[name]
        decode_step = (t["generate_s"] - t["prefill_s"]) / (args.decode_steps - 1)
        rest_decode = (rest["generate_s"] - rest["prefill_s"]) / (args.decode_steps - 1)
        rows[name] = {
            "train_step_ms": 1e3 * t["train_s"], "train_tokens_per_s": tokens / t["train_s"],
            "train_moe_ms": 1e3 * (t["train_s"] - rest["train_s"]),
            "train_moe_share": (t["train_s"] - rest["train_s"]) / t["train_s"],
            "train_peak_bytes": t["train_peak_bytes"],
            "prefill_ms": 1e3 * t["prefill_s"], "prefill_moe_ms": 1e3 * (t["prefill_s"] - rest["prefill_s"]),
            "decode_step_ms": 1e3 * decode_step, "decode_moe_step_ms": 1e3 * (decode_step - rest_decode),
            "generate_tokens_per_s": args.batch * args.decode_steps / t["generate_s"],
        }
        # Per repetition (the implementations alternate within one): decode is host-bound and its MoE
        # time a difference of two steps, so the spread over repetitions is part of the figure.
        steps, rest_steps = decode_steps_per_rep(t, args), decode_steps_per_rep(rest, args)
        rows[name]["decode_step_ms_reps"] = [1e3 * s for s in steps]
        rows[name]["decode_moe_step_ms_reps"] = [1e3 * (s - r) for s, r in zip(steps, rest_steps)]
    if "grouped_mm" in rows:
        base = rows["grouped_mm"]
        for row in rows.values():
            row["moe_speedup_vs_grouped_mm"] = {key: base[key] / row[key] for key in
                                                ("train_moe_ms", "prefill_moe_ms", "decode_moe_step_ms")}
            ratios = sorted(b / r for b, r in zip(base["decode_step_ms_reps"], row["decode_step_ms_reps"]))
            row["decode_step_speedup_vs_grouped_mm_reps"] = {"median": statistics.median(ratios), "min": ratios[0],
                                                              "max": ratios[-1]}
    rows["zero (the rest of the model)"] = {"train_step_ms": 1e3 * rest["train_s"],
                                            "prefill_ms": 1e3 * rest["prefill_s"]}
    return rows


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    device = {"torch_name": torch.cuda.get_device_name(), **device_identity()} if args.device.startswith(
        "cuda") else {"torch_name": "cpu"}
    poise_hf.configure(max_tokens=args.batch * args.seq)
    model = build_model(args)
    rows = summarize(measure(model, args), args)
    result = {"benchmark": "transformers", "commit": commit_of(args.commit), "device": device,
              "model": {"family": args.family, "tiny": args.tiny, "layers": args.layers,
                        "attn_implementation": model.config._attn_implementation, **model.config.to_diff_dict()},
              "batch": args.batch, "seq": args.seq, "decode_steps": args.decode_steps, "reps": args.reps,
              "transformers": transformers.__version__, "torch": torch.__version__, "results": rows,
              "seconds": time.perf_counter() - started}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    for name, row in rows.items():
        print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
