"""poise.routed_experts with expert biases (gpt-oss: b13 before the activation, b2 before the score)
and with weights stored transposed (weights_transposed=True: w13 [E_local, D, 2F], w2 [E_local, F, D])
on a CPU context: forward and every gradient against plain PyTorch in float64, the transposed layout
against the plain one bit for bit, clip statistics and gradient accumulation with biases, the ops'
contracts (opcheck, make_fx) and what is refused, by name. tests/python/test_torch_gpu.py runs the
same calls on the GPU against the CPU reference."""

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import poise
from poise import reference

CONFIG = poise.Config(num_local_input_tokens=32, hidden_dim=256, intermediate_dim=64, top_k=2, num_experts=4,
                      activation="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0)
NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2", "b13", "b2")
DIFFERENTIABLE = ("x_TD", "scores_TK", "w13", "w2", "b13", "b2")


def layer(seed=0, free_fraction=0.0, requires_grad=True, config=CONFIG):
    inputs = {n: v[0] for n, v in reference.random_inputs(config, 1, seed=seed, free_fraction=free_fraction).items()}
    generator = torch.Generator().manual_seed(seed + 100)
    inputs["b13"] = (torch.randn(4, 2 * config.intermediate_dim, generator=generator) * 0.3).bfloat16()
    inputs["b2"] = (torch.randn(4, config.hidden_dim, generator=generator) * 0.3).bfloat16()
    for name in DIFFERENTIABLE:
        inputs[name].requires_grad_(requires_grad)
    return inputs


def transposed(inputs):
    """The same layer with its weights stored for x @ W ([E, D, 2F] / [E, F, D]), as new leaves."""
    out = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in inputs.items()}
    for name in ("w13", "w2"):
        out[name] = inputs[name].detach().transpose(1, 2).contiguous().requires_grad_(inputs[name].requires_grad)
    return out


def call(inputs, context, biased=True, **kwargs):
    biases = dict(b13=inputs["b13"], b2=inputs["b2"]) if biased else {}
    return poise.routed_experts(*[inputs[n] for n in NAMES[:5]], context, **biases, **kwargs)


def relative_error(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("layout, free_fraction", [("gate_up_interleaved", 0.0), ("gate_up_blocked", 0.3)])
def test_forward_and_every_gradient_match_plain_pytorch_float64(layout, free_fraction):
    inputs = layer(seed=1, free_fraction=free_fraction)
    grad_out = torch.randn(32, 256).bfloat16()
    with poise.create_context(config=CONFIG, device="cpu") as context:
        out = call(inputs, context, w13_layout=layout)
        out.backward(grad_out)
    leaves = {n: inputs[n].detach().double().requires_grad_() for n in DIFFERENTIABLE}
    want = reference.routed_experts_torch(leaves["x_TD"], inputs["ids_TK"], leaves["scores_TK"], leaves["w13"],
                                          leaves["w2"], CONFIG, w13_layout=layout, b13_E2F=leaves["b13"],
                                          b2_ED=leaves["b2"])
    want.backward(grad_out.double())
    assert relative_error(out, want) < 1e-2
    for name in DIFFERENTIABLE:
        assert inputs[name].grad.dtype == inputs[name].dtype, name
        assert relative_error(inputs[name].grad, leaves[name].grad) < 1e-2, name


def run(inputs, context, grad_out, **kwargs):
    """out (and clip counts, if asked) and the grads of every differentiable input the call took."""
    result = call(inputs, context, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    out.backward(grad_out)
    names = DIFFERENTIABLE if kwargs.get("biased", True) else DIFFERENTIABLE[:4]
    return result, {n: inputs[n].grad for n in names}


@pytest.mark.parametrize("biased", [True, False])
@pytest.mark.parametrize("layout", ["gate_up_interleaved", "gate_up_blocked"])
@pytest.mark.parametrize("eager_bypass", [True, False])
def test_transposed_weights_give_the_plain_layouts_results_bit_for_bit(biased, layout, eager_bypass, monkeypatch):
    """weights_transposed=True on the weights stored for x @ W computes what the plain layout does on
    the same weights, and hands back the weight grads in the transposed layout (clip counts too)."""
    monkeypatch.setattr(poise.torch.autograd, "EAGER_BYPASS", eager_bypass)
    config = dataclasses.replace(CONFIG, swiglu_limit=0.5)  # clips some inputs
    plain = layer(seed=4, config=config)
    flipped = transposed(plain)
    assert flipped["w13"].shape == (4, 256, 128) and flipped["w2"].shape == (4, 64, 256)
    grad_out = torch.randn(32, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    clips = poise.ExecutionOptions(clip_statistics=True)
    with poise.create_context(config=config, device="cpu") as context:
        (out, counts), grads = run(plain, context, grad_out, biased=biased, w13_layout=layout, options=clips)
        (out_t, counts_t), grads_t = run(flipped, context, grad_out, biased=biased, w13_layout=layout,
                                         options=clips, weights_transposed=True)
    assert torch.equal(out_t, out) and torch.equal(counts_t, counts) and counts.sum() > 0
    assert (type(out_t.grad_fn).__name__ == "EagerForwardBackward") == eager_bypass
    for name, grad in grads.items():
        got = grads_t[name].transpose(1, 2) if name in ("w13", "w2") else grads_t[name]
        assert grads_t[name].is_contiguous() and grads_t[name].shape == flipped[name].shape, name
        assert torch.equal(got, grad), name


def test_transposed_weights_with_virtual_ranks_bit_for_bit():
    """poise.routed_experts_virtual with weights_transposed=True: the plain layout's outputs and
    grads on two CPU virtual ranks."""
    config = dataclasses.replace(CONFIG, num_experts=8)
    generated = reference.random_inputs(config, 2, seed=6)
    results = []
    for flip in (False, True):
        lists = {n: [t.clone() for t in generated[n]] for n in NAMES[:5]}
        if flip:
            lists["w13"], lists["w2"] = ([w.transpose(1, 2).contiguous() for w in lists[n]] for n in ("w13", "w2"))
        for name in DIFFERENTIABLE[:4]:
            for t in lists[name]:
                t.requires_grad_()
        with poise.create_context(config=config, device="cpu", ep_size=2, virtual_ranks=True) as context:
            outs = poise.routed_experts_virtual(*[lists[n] for n in NAMES[:5]], context, weights_transposed=flip)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        grads = {n: [t.grad.transpose(1, 2) if flip and n in ("w13", "w2") else t.grad for t in lists[n]]
                 for n in DIFFERENTIABLE[:4]}
        results.append((outs, grads))
    (outs, grads), (outs_t, grads_t) = results
    assert all(torch.equal(a, b) for a, b in zip(outs_t, outs))
    for name in grads:
        assert all(torch.equal(a, b) for a, b in zip(grads_t[name], grads[name])), name


@pytest.mark.parametrize("weights_transposed", [False, True])
def test_accumulate_wgrad_adds_the_weight_and_bias_grads_into_main_grad(weights_transposed):
    """With biases and accumulate_wgrad, every parameter's fp32 grad is added into its main_grad
    (what the plain call returns, there rounded to bf16) and autograd's .grad stays None."""
    inputs = layer(seed=7)
    if weights_transposed:
        inputs = transposed(inputs)
    grad_out = torch.randn(32, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    parameters = ("w13", "w2", "b13", "b2")
    with poise.create_context(config=CONFIG, device="cpu") as context:
        _, plain = run(inputs, context, grad_out, weights_transposed=weights_transposed)
        for name in DIFFERENTIABLE:
            inputs[name].grad = None
        start = {n: torch.randn(inputs[n].shape, generator=torch.Generator().manual_seed(9)) for n in parameters}
        for name in parameters:
            inputs[name].main_grad = start[name].clone()
        _, accumulated = run(inputs, context, grad_out, weights_transposed=weights_transposed,
                             options=poise.ExecutionOptions(accumulate_wgrad=True))
    for name in parameters:
        assert accumulated[name] is None, name
        added = inputs[name].main_grad - start[name]
        assert relative_error(added, plain[name]) < 1e-2, name
    for name in ("x_TD", "scores_TK"):
        assert torch.equal(accumulated[name], plain[name]), name


def test_accumulating_into_a_bias_without_a_buffer_of_wgrad_dtype_is_named():
    """fp32 wgrad_dtype and a bf16 b13 without .main_grad: nowhere to add its fp32 grad."""
    inputs = layer(seed=10)
    for name in ("w13", "w2", "b2"):
        inputs[name].main_grad = torch.zeros(inputs[name].shape)
    with poise.create_context(config=CONFIG, device="cpu") as context:
        out = call(inputs, context, options=poise.ExecutionOptions(accumulate_wgrad=True))
        with pytest.raises(poise.InvalidArgument) as raised:
            out.float().sum().backward()
    assert raised.value.name == "b13" and "main_grad" in raised.value.rule


def test_the_biased_ops_pass_opcheck_and_trace():
    inputs = layer(seed=2, requires_grad=False)
    grad_out = torch.randn(32, 256).bfloat16()
    with poise.create_context(config=CONFIG, device="cpu") as context:
        for flip in (False, True):
            tensors = [transposed(inputs)[n] if flip else inputs[n] for n in NAMES]
            args = (*tensors, context.handle, "gate_up_blocked", flip)
            torch.library.opcheck(torch.ops.poise.routed_experts_biased_forward.default, (*args, False))
            torch.library.opcheck(torch.ops.poise.routed_experts_biased_forward_clip_counts.default, (*args, False))
            torch.library.opcheck(torch.ops.poise.routed_experts_biased_backward.default, (grad_out, *args))
            buffers = [torch.zeros(t.shape) for t in tensors[3:]]
            torch.library.opcheck(torch.ops.poise.routed_experts_biased_backward_accumulate.default,
                                  (grad_out, *args, *buffers))

        def fn(*tensors):
            return call(dict(zip(NAMES, tensors)), context, weights_transposed=True) * 2

        graph = make_fx(fn, tracing_mode="fake")(*[transposed(inputs)[n] for n in NAMES])
        assert "poise.routed_experts_biased_forward" in graph.code


# (the call's changes, the name the error must carry, a fragment of its rule)
MISTAKES = {
    "b2 missing": (lambda i: dict(b2=None), "b2", "together"),
    "b13 too narrow": (lambda i: dict(b13=i["b13"][:, :64].contiguous()), "b13", "[4, 128]"),
    "w13 plain with weights_transposed": (lambda i: dict(weights_transposed=True, w2=transposed(i)["w2"]), "w13",
                                          "[E_local, D, 2F] (weights_transposed=True)"),
    "w2 plain with weights_transposed": (lambda i: dict(weights_transposed=True, w13=transposed(i)["w13"]), "w2",
                                         "[E_local, F, D] (weights_transposed=True)"),
    "w13 transposed without the flag": (lambda i: dict(w13=transposed(i)["w13"]), "w13", "[E_local, 2, F, D]"),
    "weights_transposed not a bool": (lambda i: dict(weights_transposed=1), "weights_transposed", "bool"),
}


@pytest.mark.parametrize("tracing", [False, True])
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_mistakes_are_named(mistake, tracing):
    """Eagerly and under FakeTensor tracing (the fake implementations run the same checks)."""
    changes, name, fragment = MISTAKES[mistake]
    inputs = layer(seed=3, requires_grad=False)
    arguments = {**{n: inputs[n] for n in NAMES}, "weights_transposed": False, **changes(inputs)}
    tensors = {n: v for n, v in arguments.items() if isinstance(v, torch.Tensor)}  # traced as fake tensors
    with poise.create_context(config=CONFIG, device="cpu") as context:
        def fn(*values):
            given = {**arguments, **dict(zip(tensors, values))}
            return poise.routed_experts(*[given.pop(n) for n in NAMES[:5]], context, **given)

        with pytest.raises(poise.InvalidArgument) as raised:
            make_fx(fn, tracing_mode="fake")(*tensors.values()) if tracing else fn(*tensors.values())
    assert raised.value.name == name and fragment in raised.value.rule, raised.value


def test_virtual_ranks_name_a_weight_of_the_wrong_layout():
    config = dataclasses.replace(CONFIG, num_experts=8)
    generated = reference.random_inputs(config, 2, seed=11)
    with poise.create_context(config=config, device="cpu", ep_size=2, virtual_ranks=True) as context:
        with pytest.raises(poise.InvalidArgument) as raised:
            poise.routed_experts_virtual(*[generated[n] for n in NAMES[:5]], context, weights_transposed=True)
    assert raised.value.name == "w13" and raised.value.rule.startswith("rank 0: ")
