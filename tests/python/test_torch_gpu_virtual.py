"""The torch ops on virtual-ranks contexts (all R ranks on this GPU, poise.routed_experts_virtual;
pytest -m gpu) against the CPU reference: both balance modes, routings, wgrad dtypes, W13 layouts,
the raw binding, CUDA graph replay, and clamped SwiGLU clip statistics."""

import dataclasses

import pytest
import torch

import poise
from poise import reference
from gpu_cases import (BIASED_NAMES, BLOCKED, CONFIG, GPT_OSS, INTERLEAVED, NAMES, TOLERANCE, biased_inputs_on,
                       flip_weight, poison_allocator, reference_virtual, relative_error)

pytestmark = pytest.mark.gpu


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


@pytest.mark.parametrize("ep_size, balance, routing, w13_layout",
                         [(2, "exact", "one_expert", INTERLEAVED), (4, "capacity", "uniform", BLOCKED)])
def test_virtual_ranks_with_transposed_weights_match_the_cpu_reference(ep_size, balance, routing, w13_layout):
    """poise.routed_experts_virtual with weights_transposed=True (w13 [E_local, D, 2F], w2
    [E_local, F, D] per rank, read as stored) against the reference given the plain layout."""
    config = dataclasses.replace(CONFIG, balance=balance)
    device = torch.device("cuda", torch.cuda.current_device())
    generated = reference.random_inputs(config, ep_size, seed=25 + ep_size, routing=routing)
    per_rank = [{n: flip_weight(generated[n][r], n, True).contiguous().to(device).requires_grad_(n != "ids_TK")
                 for n in NAMES} for r in range(ep_size)]
    grad_out = [torch.randn(config.num_local_input_tokens, config.hidden_dim, device=device).bfloat16()
                for _ in range(ep_size)]
    with poise.create_context(config=config, device=device, ep_size=ep_size, virtual_ranks=True) as context:
        poison_allocator(device, [inputs["x_TD"] for inputs in per_rank])
        outs = poise.routed_experts_virtual(*[[inputs[n] for inputs in per_rank] for n in NAMES], context,
                                            w13_layout=w13_layout, weights_transposed=True)
        poison_allocator(device, [inputs[n].detach() for inputs in per_rank for n in ("x_TD", "scores_TK", "w13", "w2")])
        torch.autograd.backward(outs, grad_out)
        context.check()
    want_outs, want_grads = reference_virtual(config, [{n: generated[n][r] for n in NAMES} for r in range(ep_size)],
                                              grad_out, w13_layout)
    for r in range(ep_size):
        assert relative_error(outs[r], want_outs[r]) < TOLERANCE, r
        for name in ("x_TD", "scores_TK", "w13", "w2"):
            got = per_rank[r][name].grad
            assert got.shape == per_rank[r][name].shape, (r, name)
            assert relative_error(got, flip_weight(want_grads[r][name], name, True)) < TOLERANCE, (r, name)


def test_virtual_ranks_raw_binding_with_expert_biases_and_transposed_weights():
    """The per-rank entry points with b13 / b2 and weights_transposed on 4 ranks, one hot expert
    (exact balance replicates it, biases with it), fp32 weight and bias grads into NaN buffers,
    against reference.Engine given the plain layout."""
    ep_size = 4
    device = torch.device("cuda", torch.cuda.current_device())
    per_rank = biased_inputs_on(device, seed=31, routing="one_expert", weights_transposed=True, ep_size=ep_size)
    grad_out = [torch.randn(GPT_OSS.num_local_input_tokens, GPT_OSS.hidden_dim, device=device).bfloat16()
                for _ in range(ep_size)]
    column = {n: [inputs[n].data_ptr() for inputs in per_rank] for n in BIASED_NAMES}

    def nan_like(name, dtype=None):
        return [torch.full_like(inputs[name], float("nan"), dtype=dtype) for inputs in per_rank]

    def addresses(tensors):
        return [t.data_ptr() for t in tensors]

    out, grad_x, grad_scores = nan_like("x_TD"), nan_like("x_TD"), nan_like("scores_TK")
    grads = {n: nan_like(n, torch.float32) for n in ("w13", "w2", "b13", "b2")}
    stream = torch.cuda.current_stream(device).cuda_stream
    with poise.create_context(config=GPT_OSS, device=device, ep_size=ep_size, virtual_ranks=True) as context:
        poise._poise.routed_experts_forward_ranks(
            context._cpp, column["x_TD"], column["ids_TK"], column["scores_TK"], "fp32", column["w13"], INTERLEAVED,
            column["w2"], addresses(out), stream, b13=column["b13"], b2=column["b2"], weights_transposed=True)
        poise._poise.routed_experts_backward_ranks(
            context._cpp, column["x_TD"], column["ids_TK"], column["scores_TK"], "fp32", column["w13"], INTERLEAVED,
            column["w2"], addresses(grad_out), addresses(grad_x), addresses(grad_scores), addresses(grads["w13"]),
            addresses(grads["w2"]), False, stream, b13=column["b13"], b2=column["b2"], weights_transposed=True,
            grad_b13=addresses(grads["b13"]), grad_b2=addresses(grads["b2"]))
        context.check()
    engine = reference.Engine(GPT_OSS, ep_size)
    plain = {n: [flip_weight(inputs[n], n, True).contiguous().cpu() for inputs in per_rank] for n in BIASED_NAMES}
    want_outs = engine.forward(*[plain[n] for n in NAMES], w13_layout=INTERLEAVED, b13=plain["b13"], b2=plain["b2"])
    assert max(engine.routing_stats.replicas) > 0  # the hot expert was replicated, its biases with it
    want = engine.backward([g.cpu() for g in grad_out])
    for r in range(ep_size):
        assert relative_error(out[r], want_outs[r]) < TOLERANCE, r
        got = {"x_TD": grad_x[r], "scores_TK": grad_scores[r], **{n: grads[n][r] for n in grads}}
        for name, value in got.items():
            expected = flip_weight(getattr(want[r], "grad_" + name), name, True)
            assert relative_error(value, expected) < TOLERANCE, (r, name)


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


@pytest.mark.parametrize("ep_size, balance, routing, free_fraction",
                         [(1, "exact", "uniform", 0.3), (4, "exact", "one_expert", 0.0), (4, "exact", "uniform", 0.5),
                          (8, "capacity", "uniform", 0.2)])
def test_routing_stats_equal_the_cpu_reference(ep_size, balance, routing, free_fraction):
    """Context.routing_stats on the GPU (device tensors, no sync) equals the CPU context's, rank by rank."""
    config = dataclasses.replace(CONFIG, balance=balance, receive_capacity_factor=float(ep_size))
    generated = reference.random_inputs(config, ep_size, seed=40 + ep_size, routing=routing,
                                        free_fraction=free_fraction)
    device = torch.device("cuda", torch.cuda.current_device())
    stats = {}
    for where in ("cpu", device):
        with poise.create_context(config=config, device=where, ep_size=ep_size, virtual_ranks=True) as context:
            with torch.no_grad():
                poise.routed_experts_virtual(*[[t.to(where) for t in generated[n]] for n in NAMES], context)
            stats[str(where)] = context.routing_stats()
    for rank, (gpu, cpu) in enumerate(zip(stats[str(device)], stats["cpu"])):
        assert gpu.expert_rows.device == device
        for field in ("expert_rows", "owner_rows", "computed_rows", "replicas", "received_token_rows"):
            assert torch.equal(getattr(gpu, field).cpu(), getattr(cpu, field)), (rank, field)
