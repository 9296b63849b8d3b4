"""poise.routed_experts with expert biases (gpt-oss: b13 before the activation, b2 before the score)
on a CPU context: forward and every gradient against plain PyTorch in float64, the biased ops'
contracts (opcheck, make_fx), and what is refused, by name. tests/python/test_torch_gpu.py checks
that a GPU context refuses biases before any kernel."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import poise
from poise import reference

CONFIG = poise.Config(num_local_input_tokens=32, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=4,
                      activation="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0)
NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2", "b13", "b2")
DIFFERENTIABLE = ("x_TD", "scores_TK", "w13", "w2", "b13", "b2")


def layer(seed=0, free_fraction=0.0, requires_grad=True):
    inputs = {n: v[0] for n, v in reference.random_inputs(CONFIG, 1, seed=seed, free_fraction=free_fraction).items()}
    generator = torch.Generator().manual_seed(seed + 100)
    inputs["b13"] = (torch.randn(4, 128, generator=generator) * 0.3).bfloat16()
    inputs["b2"] = (torch.randn(4, 128, generator=generator) * 0.3).bfloat16()
    for name in DIFFERENTIABLE:
        inputs[name].requires_grad_(requires_grad)
    return inputs


def call(inputs, context, **kwargs):
    return poise.routed_experts(*[inputs[n] for n in NAMES[:5]], context, b13=inputs["b13"], b2=inputs["b2"], **kwargs)


def relative_error(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("layout, free_fraction", [("gate_up_interleaved", 0.0), ("gate_up_blocked", 0.3)])
def test_forward_and_every_gradient_match_plain_pytorch_float64(layout, free_fraction):
    inputs = layer(seed=1, free_fraction=free_fraction)
    grad_out = torch.randn(32, 128).bfloat16()
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


def test_the_biased_ops_pass_opcheck_and_trace():
    inputs = layer(seed=2, requires_grad=False)
    with poise.create_context(config=CONFIG, device="cpu") as context:
        args = (*[inputs[n] for n in NAMES], context.handle, "gate_up_blocked")
        torch.library.opcheck(torch.ops.poise.routed_experts_biased_forward.default, args)
        grad_out = torch.randn(32, 128).bfloat16()
        torch.library.opcheck(torch.ops.poise.routed_experts_biased_backward.default, (grad_out, *args))

        def fn(*tensors):
            return call(dict(zip(NAMES, tensors)), context) * 2

        graph = make_fx(fn, tracing_mode="fake")(*[inputs[n] for n in NAMES])
        assert "poise.routed_experts_biased_forward" in graph.code


def test_what_is_refused_is_named():
    inputs = layer(seed=3)
    with poise.create_context(config=CONFIG, device="cpu") as context:
        with pytest.raises(poise.InvalidArgument) as raised:
            poise.routed_experts(*[inputs[n] for n in NAMES[:5]], context, b13=inputs["b13"])
        assert raised.value.name == "b2"
        with pytest.raises(poise.InvalidArgument) as raised:
            poise.routed_experts(*[inputs[n] for n in NAMES[:5]], context, b13=inputs["b13"][:, :64], b2=inputs["b2"])
        assert raised.value.name == "b13"
        for options in (poise.ExecutionOptions(accumulate_wgrad=True), poise.ExecutionOptions(clip_statistics=True)):
            with pytest.raises(poise.NotAvailable):
                call(inputs, context, options=options)
