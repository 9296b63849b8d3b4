"""Expert biases (gpt-oss) through poise.reference: the C++ engine against the float64 oracle and the
plain-PyTorch layer, bias gradients included; named errors."""

import pytest
import torch

import poise
from poise import reference

CONFIG = poise.Config(num_local_input_tokens=24, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=8,
                      activation="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0)
NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")


def biases(ep_size, seed):
    generator = torch.Generator().manual_seed(seed)
    local = CONFIG.num_experts // ep_size
    return ([(torch.randn(local, 2 * CONFIG.intermediate_dim, generator=generator) * 0.1).bfloat16()
             for _ in range(ep_size)],
            [(torch.randn(local, CONFIG.hidden_dim, generator=generator) * 0.1).bfloat16() for _ in range(ep_size)])


def relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("ep_size, layout", [(1, "gate_up_interleaved"), (2, "gate_up_blocked"),
                                             (4, "gate_up_interleaved")])
def test_engine_matches_float64_with_bias_gradients(ep_size, layout):
    inputs = reference.random_inputs(CONFIG, ep_size, seed=ep_size, routing="one_expert")
    b13, b2 = biases(ep_size, 7)
    grad_out = [torch.randn(24, 128).bfloat16() for _ in range(ep_size)]
    engine = reference.Engine(CONFIG, ep_size)
    outs = engine.forward(*[inputs[n] for n in NAMES], w13_layout=layout, b13=b13, b2=b2)
    grads = engine.backward(grad_out)
    want = reference.dense_float64(CONFIG, ep_size, *[inputs[n] for n in NAMES], grad_out_TD=grad_out,
                                   w13_layout=layout, b13=b13, b2=b2)
    for r in range(ep_size):
        assert relative_error(outs[r], want["out_TD"][r]) < 1e-2
        assert relative_error(grads[r].grad_x_TD, want["grad_x_TD"][r]) < 1e-2
        assert relative_error(grads[r].grad_b13, want["grad_b13"][r]) < 1e-2
        assert relative_error(grads[r].grad_b2, want["grad_b2"][r]) < 1e-2
    # The plain-PyTorch layer agrees (one rank: its experts are the rank's).
    if ep_size == 1:
        w13_E2FD, w2_EDF = reference.global_experts(inputs["w13"], inputs["w2"], CONFIG)
        torch_out = reference.routed_experts_torch(inputs["x_TD"][0].double(), inputs["ids_TK"][0],
                                                   inputs["scores_TK"][0].double(), w13_E2FD.double(),
                                                   w2_EDF.double(), CONFIG, w13_layout=layout,
                                                   b13_E2F=b13[0].double(), b2_ED=b2[0].double())
        assert relative_error(outs[0], torch_out) < 1e-2


def test_without_biases_the_bias_gradients_are_none():
    inputs = reference.random_inputs(CONFIG, 1, seed=3)
    engine = reference.Engine(CONFIG, 1)
    engine.forward(*[inputs[n] for n in NAMES])
    (grads,) = engine.backward([torch.randn(24, 128).bfloat16()])
    assert grads.grad_b13 is None and grads.grad_b2 is None


def test_bias_errors_name_the_argument():
    inputs = reference.random_inputs(CONFIG, 1, seed=4)
    b13, b2 = biases(1, 5)
    engine = reference.Engine(CONFIG, 1)

    def name_of(**kwargs):
        with pytest.raises(poise.InvalidArgument) as raised:
            engine.forward(*[inputs[n] for n in NAMES], **kwargs)
        return raised.value.name

    assert name_of(b13=b13) == "b2"
    assert name_of(b13=[b13[0].float()], b2=b2) == "b13"
    assert name_of(b13=b13, b2=[b2[0][:, :64].contiguous()]) == "b2"
