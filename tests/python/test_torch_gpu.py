"""The torch ops on one GPU rank (run on a device machine: pytest -m gpu), against the CPU reference:
forward and backward, CUDA graphs, layers sharing a context, activation slots, the example under
torchrun, stage timing, and the bytes a context holds against its memory plan."""

import dataclasses
import subprocess
import sys

import pytest
import torch

import poise
from poise import reference
from gpu_cases import (BIASED_NAMES, BLOCKED, CONFIG, DIFFERENTIABLE, GPT_OSS, INTERLEAVED, NAMES, TOLERANCE,
                       biased_inputs_on, cpu_biased_result, cpu_result, flip_weight, inputs_on,
                       poison_allocator, relative_error)

pytestmark = pytest.mark.gpu


def test_forward_and_backward_match_the_cpu_reference():
    device = torch.device("cuda", torch.cuda.current_device())
    for routing, free_fraction in (("uniform", 0.0), ("one_expert", 0.0), ("uniform", 0.5)):
        inputs = inputs_on(device, seed=1, routing=routing, free_fraction=free_fraction)[0]
        for name in ("x_TD", "scores_TK", "w13", "w2"):
            inputs[name].requires_grad_()
        grad_out = torch.randn(CONFIG.num_local_input_tokens, CONFIG.hidden_dim, device=device).bfloat16()
        with poise.create_context(config=CONFIG, device=device) as context:
            out = poise.routed_experts(*[inputs[n] for n in NAMES], context)
            out.backward(grad_out)
            context.check()  # device-side faults surface here
        want_out, want_grads = cpu_result(inputs, grad_out)
        assert relative_error(out, want_out) < TOLERANCE
        for name, want in zip(("x_TD", "scores_TK", "w13", "w2"), want_grads):
            assert relative_error(inputs[name].grad, want) < TOLERANCE, (routing, name)
        free = inputs["ids_TK"] == -1
        assert bool(free.any()) == (free_fraction > 0)
        assert bool((inputs["scores_TK"].grad[free] == 0).all()), "a free entry (id -1) got a score gradient"


def test_cuda_graph_capture_and_replay_for_any_routing():
    device = torch.device("cuda", torch.cuda.current_device())
    static = inputs_on(device, seed=2)[0]
    w13 = torch.nn.Parameter(static.pop("w13"))
    w2 = torch.nn.Parameter(static.pop("w2"))
    static["x_TD"].requires_grad_()
    static["scores_TK"].requires_grad_()
    grad_out = torch.randn(CONFIG.num_local_input_tokens, CONFIG.hidden_dim, device=device).bfloat16()
    with poise.create_context(config=CONFIG, device=device) as context:
        def step():
            out = poise.routed_experts(static["x_TD"], static["ids_TK"], static["scores_TK"], w13, w2, context)
            out.backward(grad_out)
            return out

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        for t in (static["x_TD"], static["scores_TK"], w13, w2):
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()

        # Replay with routings the capture never saw, free entries (id -1) too: the launch sequence
        # does not depend on them.
        for seed, routing, free in ((3, "uniform", 0.0), (4, "one_expert", 0.0), (5, "uniform", 0.0),
                                    (6, "uniform", 0.7)):
            fresh = inputs_on(device, seed=seed, routing=routing, free_fraction=free)[0]
            with torch.no_grad():
                for name in ("x_TD", "ids_TK", "scores_TK"):
                    static[name].copy_(fresh[name])
                for t in (static["x_TD"], static["scores_TK"], w13, w2):
                    t.grad.zero_()
            graph.replay()
            context.check()
            want_out, want_grads = cpu_result({**static, "w13": w13, "w2": w2}, grad_out)
            assert relative_error(static_out, want_out) < TOLERANCE, routing
            for got, want in zip((static["x_TD"].grad, static["scores_TK"].grad, w13.grad, w2.grad), want_grads):
                assert relative_error(got, want) < TOLERANCE, routing


def layers_with_grads(device, seeds):
    """One layer's inputs per seed, x, scores and weights requiring grad."""
    layers = [inputs_on(device, seed=s)[0] for s in seeds]
    for inputs in layers:
        for name in ("x_TD", "scores_TK", "w13", "w2"):
            inputs[name].requires_grad_()
    return layers


def assert_grads_match_cpu(layers, grad_out):
    for inputs in layers:
        _, want_grads = cpu_result(inputs, grad_out)
        for name, want in zip(("x_TD", "scores_TK", "w13", "w2"), want_grads):
            assert relative_error(inputs[name].grad, want) < TOLERANCE, name


def test_layers_sharing_a_context_and_no_grad_in_between():
    """The GPU backward differentiates the latest forward: the torch op relaunches an older one."""
    device = torch.device("cuda", torch.cuda.current_device())
    layers = layers_with_grads(device, (7, 8))
    grad_out = torch.randn(CONFIG.num_local_input_tokens, CONFIG.hidden_dim, device=device).bfloat16()
    with poise.create_context(config=CONFIG, device=device) as context:
        outs = [poise.routed_experts(*[inputs[n] for n in NAMES], context) for inputs in layers]
        with torch.no_grad():
            poise.routed_experts(*[layers[0][n] for n in NAMES], context)
        outs[1].backward(grad_out)
        outs[0].backward(grad_out)
        context.check()
        assert context._backend.recomputed_forwards == 2
    assert_grads_match_cpu(layers, grad_out)


def test_activation_slot_keeps_layers_for_backward():
    """Two layers in one activation slot: both backwards run from what their forward kept."""
    device = torch.device("cuda", torch.cuda.current_device())
    config = dataclasses.replace(CONFIG, max_moe_layers_per_activation_slot=2)
    layers = layers_with_grads(device, (11, 12))
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim, device=device).bfloat16()
    with poise.create_context(config=config, device=device) as context:
        assert context.plan.activation_records_per_slot == 2
        context.select_activation_slot(0, 2)
        outs = [poise.routed_experts(*[inputs[n] for n in NAMES], context) for inputs in layers]
        outs[1].backward(grad_out)
        outs[0].backward(grad_out)
        context.check()
        assert context._backend.recomputed_forwards == 0
    assert_grads_match_cpu(layers, grad_out)


def test_activation_slot_keeps_layers_whole_light_and_partly():
    """A slot with room for one layer whole, one without its x rows and the first 128 rows of a
    third: all three backwards run from what was kept (re-sending x rows, recomputing the third
    layer's other h13 rows), none rebuilds its forward, and the grads match the CPU reference."""
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = poise.plan_memory(dataclasses.replace(CONFIG, max_moe_layers_per_activation_slot=3), 1)
    h13_row_bytes = 4 * CONFIG.intermediate_dim
    layout = sizes.activation_light_record_bytes - sizes.balanced_rows * h13_row_bytes
    config = dataclasses.replace(
        CONFIG, max_moe_layers_per_activation_slot=3,
        activation_slot_bytes=sizes.activation_record_bytes + sizes.activation_light_record_bytes + layout
        + 128 * h13_row_bytes)
    layers = layers_with_grads(device, (21, 22, 23))
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim, device=device).bfloat16()
    with poise.create_context(config=config, device=device) as context:
        plan = context.plan
        assert (plan.activation_records_per_slot, plan.activation_light_records_per_slot,
                plan.activation_partial_record_rows) == (1, 1, 128)
        context.select_activation_slot(0, 3)
        outs = [poise.routed_experts(*[inputs[n] for n in NAMES], context) for inputs in layers]
        for out in reversed(outs):
            out.backward(grad_out)
        context.check()
        assert context._backend.recomputed_forwards == 0
    assert_grads_match_cpu(layers, grad_out)


def test_train_moe_under_torchrun_one_process(repo_root):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "examples/train_moe.py", "--device", "cuda", "--steps", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 2: loss" in result.stdout


def test_stage_timing_reports_every_stage_of_both_calls():
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = inputs_on(device, seed=9)[0]
    for name in ("x_TD", "scores_TK", "w13", "w2"):
        inputs[name].requires_grad_()
    with poise.create_context(config=CONFIG, device=device) as context:
        context.enable_stage_timing()
        out = poise.routed_experts(*[inputs[n] for n in NAMES], context)
        out.float().sum().backward()
        times = context.stage_times()
    assert list(times["forward"]) == ["route", "dispatch", "fanout", "experts", "combine_push", "combine_reduce"]
    # Exact balance (CONFIG's default) adds the replica-gradient reduce after the combine push; the
    # score gradients come from the experts (DGRAD W2), so there is no grad_scores stage.
    assert list(times["backward"]) == ["dispatch", "fanout", "experts", "combine_push", "replica_grads",
                                       "combine_reduce"]
    assert all(ms >= 0 for stages in times.values() for ms in stages.values())
    assert "experts" in times["backward"] and times["forward"]["experts"] > 0


@pytest.mark.parametrize("ep_size, changes", [
    (1, dict(balance="capacity")),
    (1, dict(balance="capacity", receive_capacity_factor=3.0, num_activation_slots=2)),
    (4, dict(balance="exact")),
    (2, dict(balance="capacity", inference=True)),
])
def test_a_context_holds_what_its_memory_plan_says(ep_size, changes):
    """Context.device_bytes (window + pipeline buffers per rank, after a call) against
    plan.total_device_bytes: never more than the plan (beyond 1% + 1 MiB of small bookkeeping
    buffers), and not grossly less (the plan rounds the window to 2 MiB granules)."""
    config = dataclasses.replace(CONFIG, **changes)
    device = torch.device("cuda", torch.cuda.current_device())
    generated = reference.random_inputs(config, ep_size, seed=60)
    per_rank = [{n: generated[n][r].to(device) for n in NAMES} for r in range(ep_size)]
    virtual = ep_size > 1
    with poise.create_context(config=config, device=device, ep_size=ep_size, virtual_ranks=virtual) as context:
        with torch.no_grad():
            if virtual:
                poise.routed_experts_virtual(*[[inputs[n] for inputs in per_rank] for n in NAMES], context)
            else:
                poise.routed_experts(*[per_rank[0][n] for n in NAMES], context)
        context.check()
        held, planned = context.device_bytes, context.plan.total_device_bytes
    mib = 1 << 20
    assert held <= planned * 1.01 + mib, (held, planned)
    assert held >= planned * 0.9 - 4 * mib, (held, planned)


@pytest.mark.parametrize("transposed", [False, True])
def test_prepare_weights_on_the_gpu_equals_the_cpu_bit_for_bit_and_refills_under_a_graph(transposed):
    """poise.prepare_weights: the GPU kernel's e4m3 bits and scales are the CPU reference's (with
    transposed=True the backward's transposed copies too), and out= refills the same buffers inside a
    captured CUDA graph after the weights change in place."""
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator().manual_seed(7)
    w13 = (torch.randn(4, 384, 320, generator=generator) * 0.05).bfloat16()
    w2 = (torch.randn(4, 320, 192, generator=generator) * 0.05).bfloat16()
    w13[1, 5, 7] = float("nan")  # its block: NaN scale and NaN values, as on the CPU

    names = ("w13", "w2", "w13_t", "w2_t") if transposed else ("w13", "w2")

    def same(gpu, cpu):  # bit for bit, a NaN's payload aside (host and device NaNs differ in their bits)
        for name in names:
            a, b = getattr(gpu, name).view(torch.uint8).cpu(), getattr(cpu, name).view(torch.uint8)
            both_nan = ((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F)
            assert bool(((a == b) | both_nan).all()), name
            a, b = getattr(gpu, f"{name}_scales").cpu(), getattr(cpu, f"{name}_scales")
            assert bool(((a == b) | (a.isnan() & b.isnan())).all()), name
        assert bool(cpu.w13_scales.isnan().any())

    w13_gpu, w2_gpu = w13.to(device), w2.to(device)
    prepared = poise.prepare_weights(w13_gpu, w2_gpu, transposed=transposed)
    same(prepared, poise.prepare_weights(w13, w2, transposed=transposed))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        poise.prepare_weights(w13_gpu, w2_gpu, transposed=transposed, out=prepared)
    w13_gpu.mul_(3)  # an optimizer step, in place
    graph.replay()
    torch.cuda.synchronize()
    same(prepared, poise.prepare_weights(w13 * 3, w2, transposed=transposed))


BIASED_CASES = [  # (w13_layout, weights_transposed, routing, free_fraction)
    (INTERLEAVED, True, "uniform", 0.0),  # gpt-oss as transformers stores it
    (INTERLEAVED, True, "one_expert", 0.3),  # one hot expert, free entries
    (BLOCKED, True, "uniform", 0.5),
    (INTERLEAVED, False, "uniform", 0.0),  # biases alone
]


@pytest.mark.parametrize("w13_layout, weights_transposed, routing, free_fraction", BIASED_CASES)
def test_expert_biases_and_transposed_weights_match_the_cpu_reference(w13_layout, weights_transposed, routing,
                                                                      free_fraction):
    """gpt-oss's experts on the GPU (biases, clamped SwiGLU, weights as stored for x @ W), forward and
    every gradient, the biases' included, against a CPU context given the weights in the plain
    layout; every output and gradient buffer starts as NaN."""
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = biased_inputs_on(device, seed=50, routing=routing, free_fraction=free_fraction,
                              weights_transposed=weights_transposed)[0]
    for name in DIFFERENTIABLE:
        inputs[name].requires_grad_()
    grad_out = torch.randn(GPT_OSS.num_local_input_tokens, GPT_OSS.hidden_dim, device=device).bfloat16()
    with poise.create_context(config=GPT_OSS, device=device) as context:
        poison_allocator(device, [inputs["x_TD"]])
        out = poise.routed_experts(*[inputs[n] for n in NAMES], context, w13_layout=w13_layout,
                                   weights_transposed=weights_transposed, b13=inputs["b13"], b2=inputs["b2"])
        poison_allocator(device, [inputs[n].detach() for n in DIFFERENTIABLE])
        out.backward(grad_out)
        context.check()
    want_out, want_grads = cpu_biased_result(GPT_OSS, inputs, grad_out, w13_layout, weights_transposed)
    assert relative_error(out, want_out) < TOLERANCE
    for name in DIFFERENTIABLE:
        got = inputs[name].grad
        assert got.shape == inputs[name].shape and got.dtype == inputs[name].dtype, name
        assert relative_error(got, want_grads[name]) < TOLERANCE, (routing, name)
    free = inputs["ids_TK"] == -1
    assert bool(free.any()) == (free_fraction > 0)
    assert bool((inputs["scores_TK"].grad[free] == 0).all()), "a free entry (id -1) got a score gradient"


def test_expert_biases_with_clip_statistics_and_accumulated_grads_match_the_cpu_reference():
    """Transposed weights with biases: clip counts (on h13 with b13 added; rows at the limit may fall
    either side, so within 1% + 2) and accumulate_wgrad adding every weight and bias grad into an
    fp32 main_grad, against the CPU reference."""
    config = dataclasses.replace(GPT_OSS, swiglu_limit=0.75)  # clips a share of the inputs
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = biased_inputs_on(device, seed=51, weights_transposed=True)[0]
    parameters = ("w13", "w2", "b13", "b2")
    start = {n: torch.randn(inputs[n].shape, device=device) for n in parameters}
    for name in DIFFERENTIABLE:
        inputs[name].requires_grad_()
    for name in parameters:
        inputs[name].main_grad = start[name].clone()
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim, device=device).bfloat16()
    options = poise.ExecutionOptions(clip_statistics=True, accumulate_wgrad=True)
    with poise.create_context(config=config, device=device) as context:
        out, counts = poise.routed_experts(*[inputs[n] for n in NAMES], context, options, w13_layout=INTERLEAVED,
                                           weights_transposed=True, b13=inputs["b13"], b2=inputs["b2"])
        out.backward(grad_out)
        context.check()
    want_out, want_grads = cpu_biased_result(config, inputs, grad_out, INTERLEAVED, True)
    with poise.create_context(config=config, device="cpu") as context:
        leaves = {n: flip_weight(inputs[n].detach().cpu(), n, True).contiguous() for n in BIASED_NAMES}
        _, want_counts = poise.routed_experts(*[leaves[n] for n in NAMES], context,
                                              poise.ExecutionOptions(clip_statistics=True), w13_layout=INTERLEAVED,
                                              b13=leaves["b13"], b2=leaves["b2"])
    assert relative_error(out, want_out) < TOLERANCE
    assert want_counts.sum() > 0 and counts.dtype == torch.int64
    assert bool(((counts.cpu() - want_counts).abs() <= want_counts // 100 + 2).all()), (counts, want_counts)
    for name in parameters:
        assert inputs[name].grad is None, name  # added into main_grad instead
        added = inputs[name].main_grad - start[name]
        assert relative_error(added, want_grads[name]) < TOLERANCE, name
    for name in ("x_TD", "scores_TK"):
        assert relative_error(inputs[name].grad, want_grads[name]) < TOLERANCE, name
