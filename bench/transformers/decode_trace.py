"""Where a decode step's time goes inside the model: the MoE calls' host time per call, as the
model calls them during generate(), and the host-device synchronizations per step.

The model of bench.py (--family, 2 decoder layers, batch 8, a 1024-token prompt); each experts
implementation (poise, grouped_mm, zero) is wrapped so that every call's host time is recorded,
and generate() runs --decode-steps steps, implementations alternated over --reps repetitions. Then
one torch.profiler pass per implementation over a short generate() counts the synchronizing CUDA
calls (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, cudaMemcpy*) per
decode step. Compare with bench/transformers/decode_call.py (one Experts call alone).

  python3 bench/transformers/decode_trace.py [--out bench/results/transformers_decode_trace_h200.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import time

import torch
from transformers.integrations.moe import ExpertsInterface

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/: provenance
from provenance import commit_of, write_result  # noqa: E402


def _load_model_bench():
    """bench/transformers/bench.py (the model, the "zero" experts, "poise" registered), by path."""
    path = pathlib.Path(__file__).resolve().parent / "bench.py"
    spec = importlib.util.spec_from_file_location("transformers_model_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model_bench = _load_model_bench()

IMPLEMENTATIONS = ("poise", "grouped_mm", "zero")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def timed(implementation, calls: list):
    """The experts implementation, recording (tokens, host seconds) of every call."""
    def forward(module, hidden_states, top_k_index, top_k_weights):
        start = time.perf_counter()
        out = implementation(module, hidden_states, top_k_index, top_k_weights)
        calls.append((hidden_states.shape[0], time.perf_counter() - start))
        return out
    return forward


def sync_calls_per_step(model, prompt, steps: int, device: str) -> dict[str, float]:
    """Synchronizing CUDA calls per generated token over generate(steps) (the prefill included)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        model_bench.generation(model, prompt, steps)
        model_bench.synchronize(device)
    counts: dict[str, float] = {}
    for event in prof.key_averages():
        if any(event.key.startswith(name) for name in SYNC_CALLS):
            counts[event.key] = event.count / steps
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/transformers_decode_trace_h200.json")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(model_bench.FAMILIES))
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (a smoke test, e.g. on the CPU)")
    args = ap.parse_args(argv)
    bench_args = model_bench.parse_args(["--family", args.family, "--decode-steps", str(args.decode_steps),
                                         "--implementations", "poise,grouped_mm", "--device", args.device]
                                        + (["--tiny", "--seq", "16"] if args.tiny else []))
    model_bench.poise_hf.configure(max_tokens=bench_args.batch * bench_args.seq)
    model = model_bench.build_model(bench_args)
    prompt = torch.randint(0, model.config.vocab_size, (bench_args.batch, bench_args.seq),
                           generator=torch.Generator().manual_seed(1)).to(args.device)
    calls = {name: [] for name in IMPLEMENTATIONS}
    for name in IMPLEMENTATIONS:
        ExpertsInterface.register(f"{name}_timed", timed(ExpertsInterface._global_mapping[name], calls[name]))
    steps = {name: [] for name in IMPLEMENTATIONS}
    for rep in range(args.reps + 1):  # the first repetition warms up
        for name in IMPLEMENTATIONS:
            model.set_experts_implementation(f"{name}_timed")
            prefill = model_bench.timed(lambda: model_bench.generation(model, prompt, 1), args.device)
            whole = model_bench.timed(lambda: model_bench.generation(model, prompt, args.decode_steps), args.device)
            if rep > 0:
                steps[name].append((whole - prefill) / (args.decode_steps - 1))
            else:
                calls[name].clear()
    decode_tokens = bench_args.batch  # a decode step's MoE calls hold one token per sequence
    result = {"benchmark": "transformers_decode_trace", "commit": commit_of(args.commit),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "family": args.family, "decode_steps": args.decode_steps,
              "reps": args.reps, "results": {}}
    for name in IMPLEMENTATIONS:
        host = [seconds for tokens, seconds in calls[name] if tokens == decode_tokens]
        model.set_experts_implementation(name)
        result["results"][name] = {
            "decode_step_ms_median": 1e3 * statistics.median(steps[name]),
            "decode_step_ms_reps": [1e3 * s for s in steps[name]],
            "moe_call_host_us_median": 1e6 * statistics.median(host),
            "moe_call_host_us_quartiles": [1e6 * q for q in statistics.quantiles(host, n=4)],
            "moe_calls_per_step": len(host) / (args.reps * (args.decode_steps - 1)),
            "sync_calls_per_generated_token": sync_calls_per_step(model, prompt, 8, args.device),
        }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
