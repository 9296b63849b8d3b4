"""The torch ops on the GPU engine (run on a device machine: pytest -m gpu), against the CPU reference.

One-rank contexts and virtual-ranks contexts (all R ranks on this GPU, poise.routed_experts_virtual)
run the staged GPU pipeline. A communicator-backed context (one process per GPU) is not in this build."""

import dataclasses
import subprocess
import sys

import pytest
import torch

import poise
from poise import reference

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-2
CONFIG = poise.Config(num_local_input_tokens=128, hidden_dim=256, intermediate_dim=192, top_k=4, num_experts=8)
NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")


def relative_error(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all()
    if want.norm() == 0:  # e.g. the weight grads of an expert that received no rows: must be exactly 0
        return got.norm().item()
    return ((got - want).norm() / want.norm()).item()


def inputs_on(device, seed=0, routing="uniform", ep_size=1):
    per_rank = reference.random_inputs(CONFIG, ep_size, seed=seed, routing=routing)
    return [{name: per_rank[name][r].to(device) for name in NAMES} for r in range(ep_size)]


def cpu_result(inputs, grad_out_TD):
    """out and (grad_x, grad_scores, grad_w13, grad_w2) from a CPU context (the reference engine)."""
    leaves = {n: inputs[n].detach().cpu().requires_grad_(n != "ids_TK") for n in NAMES}
    with poise.create_context(config=CONFIG, device="cpu") as context:
        out = poise.routed_experts(*[leaves[n] for n in NAMES], context)
        out.backward(grad_out_TD.cpu())
    return out.detach(), [leaves[n].grad for n in ("x_TD", "scores_TK", "w13", "w2")]


def test_forward_and_backward_match_the_cpu_reference():
    device = torch.device("cuda", torch.cuda.current_device())
    for routing in ("uniform", "one_expert"):
        inputs = inputs_on(device, seed=1, routing=routing)[0]
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

        # Replay with routings the capture never saw: the launch sequence does not depend on them.
        for seed, routing in ((3, "uniform"), (4, "one_expert"), (5, "uniform")):
            fresh = inputs_on(device, seed=seed, routing=routing)[0]
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


def reference_virtual(config, per_rank, grad_out, w13_layout="gate_up_blocked"):
    """Every rank's out_TD and grads from the CPU reference engine (R virtual ranks, float32 math)."""
    engine = reference.Engine(config, len(per_rank))
    outs = engine.forward(**{n: [inputs[n].detach().cpu() for inputs in per_rank] for n in NAMES},
                          w13_layout=w13_layout)
    grads = engine.backward([g.cpu() for g in grad_out])
    return outs, [{"x_TD": g.grad_x_TD, "scores_TK": g.grad_scores_TK, "w13": g.grad_w13, "w2": g.grad_w2}
                  for g in grads]


def poison_allocator(device, like):
    """Fills with NaN, then frees, blocks of the sizes the op is about to allocate, so the caching
    allocator hands NaN memory to its outputs: a rank the GPU never writes cannot pass."""
    blocks = [torch.full_like(t, float("nan")) for t in like for _ in range(2)]
    torch.cuda.synchronize(device)
    del blocks


BLOCKED, INTERLEAVED = "gate_up_blocked", "gate_up_interleaved"
VIRTUAL_CASES = [(2, "exact", "uniform", "fp32", BLOCKED), (2, "exact", "one_expert", "fp32", BLOCKED),
                 (4, "exact", "uniform", "fp32", BLOCKED), (4, "exact", "one_expert", "fp32", BLOCKED),
                 (8, "exact", "uniform", "fp32", BLOCKED), (8, "exact", "one_expert", "fp32", BLOCKED),
                 (4, "capacity", "uniform", "fp32", BLOCKED), (8, "capacity", "first_rank", "fp32", BLOCKED),
                 # bf16 weight gradients (replica gradients still reduced in fp32) and interleaved W13
                 (4, "exact", "one_expert", "bf16", INTERLEAVED), (2, "capacity", "uniform", "bf16", BLOCKED)]


@pytest.mark.parametrize("ep_size, balance, routing, wgrad, w13_layout", VIRTUAL_CASES)
def test_virtual_ranks_match_the_cpu_reference(ep_size, balance, routing, wgrad, w13_layout):
    """R ranks on this GPU through poise.routed_experts_virtual, forward + autograd backward."""
    config = dataclasses.replace(CONFIG, balance=balance, wgrad_dtype=wgrad)
    if routing == "first_rank":  # every pick on rank 0's experts: needs K <= E_local, so fewer picks
        config = dataclasses.replace(config, top_k=1, receive_capacity_factor=float(ep_size))
    device = torch.device("cuda", torch.cuda.current_device())
    generated = reference.random_inputs(config, ep_size, seed=20 + ep_size, routing=routing)
    per_rank = [{n: generated[n][r].to(device).requires_grad_(n != "ids_TK") for n in NAMES} for r in range(ep_size)]
    grad_out = [torch.randn(config.num_local_input_tokens, config.hidden_dim, device=device).bfloat16()
                for _ in range(ep_size)]
    with poise.create_context(config=config, device=device, ep_size=ep_size, virtual_ranks=True) as context:
        assert context.virtual_ranks and context.device == str(device)
        poison_allocator(device, [inputs["x_TD"] for inputs in per_rank])
        outs = poise.routed_experts_virtual(*[[inputs[n] for inputs in per_rank] for n in NAMES], context,
                                            w13_layout=w13_layout)
        # The grads' blocks (the weight grads come in the weights' bf16 whatever wgrad_dtype says).
        poison_allocator(device, [t.detach().to(dtype) for inputs in per_rank for t, dtype in (
            (inputs["x_TD"], torch.bfloat16), (inputs["scores_TK"], torch.float32),
            (inputs["w13"], torch.bfloat16), (inputs["w2"], torch.bfloat16))])
        torch.autograd.backward(outs, grad_out)
        context.check()  # device-side faults (bad id, overflow, a rank that never arrived) surface here
        assert context._backend.recomputed_forwards == 0
    want_outs, want_grads = reference_virtual(config, per_rank, grad_out, w13_layout)
    for r in range(ep_size):
        assert relative_error(outs[r], want_outs[r]) < TOLERANCE, r
        for name in ("x_TD", "scores_TK", "w13", "w2"):
            got = per_rank[r][name].grad
            assert relative_error(got, want_grads[r][name].reshape(got.shape)) < TOLERANCE, (r, name)


def test_virtual_ranks_raw_binding_writes_every_poisoned_output():
    """The per-rank entry points without autograd: every output buffer starts as NaN."""
    ep_size = 4
    device = torch.device("cuda", torch.cuda.current_device())
    generated = reference.random_inputs(CONFIG, ep_size, seed=30, routing="one_expert")
    per_rank = [{n: generated[n][r].to(device) for n in NAMES} for r in range(ep_size)]
    grad_out = [torch.randn(CONFIG.num_local_input_tokens, CONFIG.hidden_dim, device=device).bfloat16()
                for _ in range(ep_size)]

    def nan_like(name, dtype=None):
        return [torch.full_like(inputs[name], float("nan"), dtype=dtype) for inputs in per_rank]

    def addresses(tensors):
        return [t.data_ptr() for t in tensors]

    column = {n: addresses(inputs[n] for inputs in per_rank) for n in NAMES}
    out, grad_x, grad_scores = nan_like("x_TD"), nan_like("x_TD"), nan_like("scores_TK")
    grad_w13, grad_w2 = nan_like("w13", torch.float32), nan_like("w2", torch.float32)
    stream = torch.cuda.current_stream(device).cuda_stream
    with poise.create_context(config=CONFIG, device=device, ep_size=ep_size, virtual_ranks=True) as context:
        poise._poise.routed_experts_forward_ranks(
            context._cpp, column["x_TD"], column["ids_TK"], column["scores_TK"], "fp32", column["w13"],
            "gate_up_blocked", column["w2"], addresses(out), stream)
        poise._poise.routed_experts_backward_ranks(
            context._cpp, column["x_TD"], column["ids_TK"], column["scores_TK"], "fp32", column["w13"],
            "gate_up_blocked", column["w2"], addresses(grad_out), addresses(grad_x), addresses(grad_scores),
            addresses(grad_w13), addresses(grad_w2), False, stream)
        context.check()
        with pytest.raises(poise.InvalidArgument) as error:  # one set per launch rank
            poise._poise.routed_experts_forward_ranks(
                context._cpp, column["x_TD"][:1], column["ids_TK"][:1], column["scores_TK"][:1], "fp32",
                column["w13"][:1], "gate_up_blocked", column["w2"][:1], addresses(out)[:1], stream)
        assert error.value.name == "args_per_rank"
    want_outs, want_grads = reference_virtual(CONFIG, per_rank, grad_out)
    for r in range(ep_size):
        assert relative_error(out[r], want_outs[r]) < TOLERANCE, r
        for name, got in (("x_TD", grad_x[r]), ("scores_TK", grad_scores[r]), ("w13", grad_w13[r]), ("w2", grad_w2[r])):
            assert relative_error(got, want_grads[r][name].reshape(got.shape)) < TOLERANCE, (r, name)


@pytest.mark.parametrize("balance, routing", [("capacity", "uniform"), ("exact", "one_expert")])
def test_weight_grads_in_the_weights_dtype_are_the_fp32_grads_rounded(balance, routing):
    """Config.wgrad_dtype='fp32', a backward asking for bf16 weight grads (what autograd does without
    accumulation): the same fp32 sums rounded once, so bitwise the fp32 call's grads cast to bf16;
    with exact balance an owner's grads take its replicas' fp32 sums after its own were rounded
    (replica_grads.cu), so those experts may differ by a rounding. Autograd's .grad is that bf16 call."""
    ep_size = 4
    config = dataclasses.replace(CONFIG, balance=balance, wgrad_dtype="fp32")
    device = torch.device("cuda", torch.cuda.current_device())
    generated = reference.random_inputs(config, ep_size, seed=35, routing=routing)
    per_rank = [{n: generated[n][r].to(device) for n in NAMES} for r in range(ep_size)]
    grad_out = [torch.randn(config.num_local_input_tokens, config.hidden_dim, device=device).bfloat16()
                for _ in range(ep_size)]

    def addresses(tensors):
        return [t.data_ptr() for t in tensors]

    column = {n: addresses(inputs[n] for inputs in per_rank) for n in NAMES}
    stream = torch.cuda.current_stream(device).cuda_stream
    grads = {}
    with poise.create_context(config=config, device=device, ep_size=ep_size, virtual_ranks=True) as context:
        out = [torch.empty_like(inputs["x_TD"]) for inputs in per_rank]
        poise._poise.routed_experts_forward_ranks(
            context._cpp, column["x_TD"], column["ids_TK"], column["scores_TK"], "fp32", column["w13"],
            "gate_up_blocked", column["w2"], addresses(out), stream)
        for dtype, name in ((torch.float32, None), (torch.bfloat16, "bf16")):
            grad_x, grad_scores = ([torch.empty_like(inputs[n]) for inputs in per_rank] for n in ("x_TD", "scores_TK"))
            grads[dtype] = [[torch.full_like(inputs[n], float("nan"), dtype=dtype) for inputs in per_rank]
                            for n in ("w13", "w2")]
            poise._poise.routed_experts_backward_ranks(
                context._cpp, column["x_TD"], column["ids_TK"], column["scores_TK"], "fp32", column["w13"],
                "gate_up_blocked", column["w2"], addresses(grad_out), addresses(grad_x), addresses(grad_scores),
                addresses(grads[dtype][0]), addresses(grads[dtype][1]), False, stream, None, name)
        with pytest.raises(poise.InvalidArgument) as error:
            poise._poise.routed_experts_backward_ranks(
                context._cpp, column["x_TD"], column["ids_TK"], column["scores_TK"], "fp32", column["w13"],
                "gate_up_blocked", column["w2"], addresses(grad_out), addresses(grad_x), addresses(grad_scores),
                addresses(grads[torch.float32][0]), addresses(grads[torch.float32][1]), False, stream, None, "fp16")
        assert error.value.name == "wgrad_dtype"
        leaves = [{n: inputs[n].clone().requires_grad_(n != "ids_TK") for n in NAMES} for inputs in per_rank]
        outs = poise.routed_experts_virtual(*[[inputs[n] for inputs in leaves] for n in NAMES], context)
        torch.autograd.backward(outs, grad_out)
        context.check()
    replicated = 0
    for w in range(2):
        for r in range(ep_size):
            name = ("w13", "w2")[w]
            fp32, bf16 = grads[torch.float32][w][r], grads[torch.bfloat16][w][r]
            assert torch.isfinite(fp32).all() and torch.isfinite(bf16).all(), (name, r)
            assert torch.equal(leaves[r][name].grad, bf16), (name, r)  # autograd: the bf16 call
            for e in range(fp32.shape[0]):  # per local expert
                rounded = fp32[e].to(torch.bfloat16)
                if torch.equal(bf16[e], rounded):
                    continue
                assert balance == "exact", (name, r, e)  # only replica sums may round twice
                replicated += 1
                # A rounding of the result, plus the own sum's rounding where the replicas cancel it.
                gap = (bf16[e].float() - rounded.float()).abs()
                assert (gap <= rounded.float().abs() * 2**-7 + fp32[e].abs().max() * 2**-8).all(), (name, r, e)
                assert relative_error(bf16[e], fp32[e]) < 2**-7, (name, r, e)  # at bf16 precision
    assert balance == "capacity" or replicated > 0  # one_expert routing replicates the hot expert


def test_virtual_ranks_cuda_graph_replays_new_routings():
    """A captured forward+backward over 4 virtual ranks replays for routings it never saw."""
    ep_size = 4
    device = torch.device("cuda", torch.cuda.current_device())
    generated = reference.random_inputs(CONFIG, ep_size, seed=40)
    static = [{n: generated[n][r].to(device).requires_grad_(n != "ids_TK") for n in NAMES} for r in range(ep_size)]
    grad_out = [torch.randn(CONFIG.num_local_input_tokens, CONFIG.hidden_dim, device=device).bfloat16()
                for _ in range(ep_size)]
    leaves = [inputs[n] for inputs in static for n in ("x_TD", "scores_TK", "w13", "w2")]
    with poise.create_context(config=CONFIG, device=device, ep_size=ep_size, virtual_ranks=True) as context:
        def step():
            outs = poise.routed_experts_virtual(*[[inputs[n] for inputs in static] for n in NAMES], context)
            torch.autograd.backward(outs, grad_out)
            return outs

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        for t in leaves:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_outs = step()
        for seed, routing in ((41, "one_expert"), (42, "uniform")):
            fresh = reference.random_inputs(CONFIG, ep_size, seed=seed, routing=routing)
            with torch.no_grad():
                for r, inputs in enumerate(static):
                    for name in ("x_TD", "ids_TK", "scores_TK"):
                        inputs[name].copy_(fresh[name][r])
                for t in leaves:
                    t.grad.fill_(float("nan"))  # the replay overwrites (grads created in the capture)
            graph.replay()
            context.check()
            want_outs, want_grads = reference_virtual(CONFIG, static, grad_out)
            for r in range(ep_size):
                assert relative_error(static_outs[r], want_outs[r]) < TOLERANCE, (routing, r)
                for name in ("x_TD", "scores_TK", "w13", "w2"):
                    got = static[r][name].grad
                    assert relative_error(got, want_grads[r][name].reshape(got.shape)) < TOLERANCE, (routing, r, name)


def test_train_moe_under_torchrun_one_process(repo_root):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "examples/train_moe.py", "--device", "cuda", "--steps", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 2: loss" in result.stdout


@pytest.mark.parametrize("ep_size, w13_layout", [(1, BLOCKED), (4, INTERLEAVED)])
def test_clip_statistics_match_the_cpu_reference(ep_size, w13_layout):
    """Clamped SwiGLU clip counts per local expert, replicas summed into their owners (exact balance,
    hot expert): the GPU counts on its bf16 h13, the reference on its own; rows at the limit may fall
    either side, so equal within 1% + 2."""
    config = dataclasses.replace(CONFIG, activation="swiglu_clamped", swiglu_limit=0.75)
    device = torch.device("cuda", torch.cuda.current_device())
    generated = reference.random_inputs(config, ep_size, seed=40 + ep_size, routing="one_expert")
    per_rank = [{n: generated[n][r].to(device) for n in NAMES} for r in range(ep_size)]
    clips = poise.ExecutionOptions(clip_statistics=True)
    with poise.create_context(config=config, device=device, ep_size=ep_size, virtual_ranks=ep_size > 1) as context:
        if ep_size == 1:
            out, counts = poise.routed_experts(*[per_rank[0][n] for n in NAMES], context, clips)
            counts = [counts]
        else:
            _, counts = poise.routed_experts_virtual(*[[inputs[n] for inputs in per_rank] for n in NAMES], context,
                                                     clips, w13_layout=w13_layout)
        context.check()
    engine = reference.Engine(config, ep_size)
    engine.forward(*[generated[n] for n in NAMES], w13_layout=w13_layout)
    for r in range(ep_size):
        got, want = counts[r].cpu(), engine.clip_counts[r]
        assert got.dtype == torch.int64 and got.shape == want.shape
        assert want.sum() > 0
        assert bool(((got - want).abs() <= want // 100 + 2).all()), (r, got, want)


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
