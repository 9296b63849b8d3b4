"""What the Python layer costs per MoE layer call, on one GPU (one rank).

For each shape, the median time of one forward+backward, four ways:
  (a) eager:  poise.routed_experts + out.backward (validation, autograd, output allocation:
              everything a training step pays per layer; plain eager calls skip torch.library's
              dispatch, poise.torch.autograd.plain_eager);
  (a') ops:   the same with that bypass off (through the torch.library ops: what calls under a
              dispatch mode or the profiler pay);
  (b) raw:    the same C++ entry points through the raw binding poise._poise.routed_experts_forward /
              _backward on preallocated buffers (no autograd, no Python-side validation);
  (c) graph:  a CUDA graph of (a), captured with torch.cuda.graph and replayed (no host work).
Python overhead per layer = a - c; binding overhead = b - c. eager_host_us is the host time an
eager forward+backward takes to return (the CPU time a layer burns; the GPU runs behind it).

Shapes: a small layer (T=256, D=1024, F=512, E=16, K=4, balance exact), where host time dominates,
and a DeepSeek-V3-ish EP1 layer (T=4096, D=7168, F=2048, E=32, K=8, balance capacity) for context.

Usage: python3 bench/python_overhead.py [out.json]   (default bench/results/python_overhead_h200.json)
Needs an SM90 GPU and the poise module built (pip install .). Runs in well under a minute.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

import torch

import poise
from provenance import commit_of  # bench/, the script's folder

SHAPES = [
    ("small", dict(num_local_input_tokens=256, hidden_dim=1024, intermediate_dim=512, num_experts=16, top_k=4,
                   balance="exact")),
    ("deepseek_v3_ep1", dict(num_local_input_tokens=4096, hidden_dim=7168, intermediate_dim=2048, num_experts=32,
                             top_k=8, balance="capacity")),
    # (Session 23 also ran it with wgrad_dtype="bf16", when the ops still returned fp32 weight grads
    # for autograd to cast: python_overhead_h200_session23_before.json.)
]
BLOCKS, WARMUP = 7, 3  # median over BLOCKS blocks, each timed as a whole


def random_layer(config: poise.Config, device: torch.device) -> dict:
    """Random inputs on the GPU (the DeepSeek weights would take minutes on the CPU)."""
    T, D, F, E, K = (config.num_local_input_tokens, config.hidden_dim, config.intermediate_dim, config.num_experts,
                     config.top_k)
    g = torch.Generator(device=device).manual_seed(0)

    def normal(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).bfloat16()

    return {
        "x_TD": normal(T, D).requires_grad_(),
        "ids_TK": torch.rand(T, E, generator=g, device=device).argsort(dim=1)[:, :K].int().contiguous(),
        "scores_TK": torch.randn(T, K, generator=g, device=device).softmax(dim=1).requires_grad_(),
        "w13": torch.nn.Parameter(normal(E, 2 * F, D, std=D**-0.5)),
        "w2": torch.nn.Parameter(normal(E, D, F, std=F**-0.5)),
        "grad_out_TD": normal(T, D),
    }


def median_ms(step, iterations: int) -> float:
    """Median over blocks of the per-iteration wall time of `iterations` back-to-back steps."""
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(BLOCKS):
        start = time.perf_counter()
        for _ in range(iterations):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / iterations)
    return statistics.median(times)


def host_us(step, iterations: int) -> float:
    """Median host time of one step (the call returns before the GPU is done)."""
    times = []
    for _ in range(BLOCKS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iterations):
            step()
        times.append((time.perf_counter() - start) * 1e6 / iterations)
    torch.cuda.synchronize()
    return statistics.median(times)


def interleaved(eager, iterations: int, rounds: int = 3) -> tuple[float, float, float, float]:
    """(ms, host us) of eager steps with the plain-eager bypass on, then off (through the
    torch.library ops: what calls under a dispatch mode or the profiler pay), each the median over
    rounds that alternate the two."""
    times = {True: ([], []), False: ([], [])}
    for _ in range(rounds):
        for bypass in (True, False):
            poise.torch.autograd.EAGER_BYPASS = bypass
            times[bypass][0].append(median_ms(eager, iterations))
            times[bypass][1].append(host_us(eager, iterations))
    poise.torch.autograd.EAGER_BYPASS = True
    return tuple(statistics.median(values) for bypass in (True, False) for values in times[bypass])


LEAVES = ("x_TD", "scores_TK", "w13", "w2")
ARGS = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")


def eager_layer(config: poise.Config, device: torch.device):
    """Random inputs, a context, and one eager forward+backward step of the layer: (layer, context, step)."""
    layer = random_layer(config, device)
    context = poise.create_context(config=config, device=device)

    def step():
        for name in LEAVES:  # optimizer.zero_grad(set_to_none=True): autograd stores fresh grads
            layer[name].grad = None
        out = poise.routed_experts(*(layer[n] for n in ARGS), context)
        out.backward(layer["grad_out_TD"])
        return out

    return layer, context, step


def measure(name: str, fields: dict, device: torch.device) -> dict:
    config = poise.Config(**fields)
    layer, context, eager = eager_layer(config, device)
    leaves = [layer[n] for n in LEAVES]
    args = [layer[n] for n in ARGS]
    small = config.num_local_input_tokens <= 1024
    iterations = 50 if small else 5

    eager()
    context.check()  # a device-side fault would make every number below meaningless
    # (a) and (a'), the bypass on and off, in alternating rounds (the host's speed drifts within a
    # call by more than the difference measured).
    eager_ms, eager_host, eager_ops_ms, eager_ops_host = interleaved(eager, iterations)

    # (b) the raw binding on preallocated buffers, same stream, same kernels.
    x, ids, scores, w13, w2 = args
    out = torch.empty_like(x)
    grad_x, grad_scores = torch.empty_like(x), torch.empty_like(scores)
    grad_w13, grad_w2 = torch.empty_like(w13), torch.empty_like(w2)  # the weights' bf16, as autograd gets them
    cpp, stream = context._cpp, torch.cuda.current_stream(device).cuda_stream
    pointers = (x.data_ptr(), ids.data_ptr(), scores.data_ptr(), "fp32", w13.data_ptr(), "gate_up_blocked",
                w2.data_ptr())

    def raw():
        poise._poise.routed_experts_forward(cpp, *pointers, out.data_ptr(), stream)
        poise._poise.routed_experts_backward(cpp, *pointers, layer["grad_out_TD"].data_ptr(), grad_x.data_ptr(),
                                             grad_scores.data_ptr(), grad_w13.data_ptr(), grad_w2.data_ptr(), False,
                                             stream, None, "bf16")

    raw_ms = median_ms(raw, iterations)

    # (c) a CUDA graph of the eager step (warmed up above; grads created inside the capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = poise.routed_experts(*args, context)
        out_graph.backward(layer["grad_out_TD"])
    graph_ms = median_ms(graph.replay, iterations)
    del graph
    # Where one eager step's GPU time goes, stage by stage (CUDA events at the stage boundaries).
    context.enable_stage_timing(True)
    eager()
    stage_ms = context.stage_times()
    context.enable_stage_timing(False)
    context.check()
    context.close()

    return {
        "name": name, "config": fields, "iterations_per_block": iterations, "blocks": BLOCKS,
        "eager_ms": eager_ms, "raw_binding_ms": raw_ms, "cuda_graph_ms": graph_ms,
        "python_overhead_us": (eager_ms - graph_ms) * 1e3, "binding_overhead_us": (raw_ms - graph_ms) * 1e3,
        "eager_host_us": eager_host, "eager_ops_ms": eager_ops_ms, "eager_ops_host_us": eager_ops_host,
        "stage_ms": stage_ms,
    }


def main() -> None:
    out_path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/python_overhead_h200.json")
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    results = [measure(name, fields, device) for name, fields in SHAPES]
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "commit": commit_of(),
              "seconds": time.perf_counter() - started, "results": results}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['device']}, torch {report['torch']}, commit {report['commit']}: forward+backward per layer")
    print(f"{'shape':<18}{'eager ms':>10}{'raw ms':>10}{'graph ms':>10}{'py ovh us':>11}{'bind ovh us':>13}"
          f"{'host us':>10}{'ops ms':>10}{'ops host us':>13}")
    for r in results:
        print(f"{r['name']:<18}{r['eager_ms']:>10.3f}{r['raw_binding_ms']:>10.3f}{r['cuda_graph_ms']:>10.3f}"
              f"{r['python_overhead_us']:>11.1f}{r['binding_overhead_us']:>13.1f}{r['eager_host_us']:>10.1f}"
              f"{r['eager_ops_ms']:>10.3f}{r['eager_ops_host_us']:>13.1f}")
    for r in results:
        for phase, stages in r["stage_ms"].items():
            print(f"{r['name']} {phase}: " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))
    print(f"wrote {out_path} ({report['seconds']:.1f} s)")


if __name__ == "__main__":
    main()
