"""Config.gemm_precision = 'fp8_block_scaled' (docs/fp8.md) from Python: checked when built, run by
the CPU reference engine through poise.routed_experts (forward and autograd), a few percent from
the float64 oracle and visibly not the BF16 result; the memory plan says it plans BF16 buffers."""

import dataclasses

import pytest

import poise

torch = pytest.importorskip("torch")
from poise import reference  # noqa: E402

CONFIG = poise.Config(num_local_input_tokens=32, hidden_dim=192, intermediate_dim=128, top_k=2, num_experts=8,
                      gemm_precision="fp8_block_scaled")


def relative_error(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def test_the_field_is_checked_by_name():
    assert poise.Config(num_local_input_tokens=8, hidden_dim=64, intermediate_dim=64, top_k=1,
                        num_experts=2).gemm_precision == "bf16"
    with pytest.raises(poise.InvalidArgument) as raised:
        dataclasses.replace(CONFIG, gemm_precision="fp8")
    assert raised.value.name == "gemm_precision"
    assert "of which FP8 operands" in poise.plan_memory(CONFIG, ep_size=1).explain()


def run(config):
    inputs = reference.random_inputs(config, 1, seed=4)
    leaves = {name: values[0].clone().requires_grad_(name != "ids_TK") for name, values in inputs.items()}
    grad_out = torch.randn(32, 192, generator=torch.Generator().manual_seed(5)).bfloat16()
    with poise.create_context(config=config, device="cpu") as context:
        out = poise.routed_experts(*(leaves[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")), context)
        out.backward(grad_out)
    grads = {name: leaves[name].grad for name in ("x_TD", "scores_TK", "w13", "w2")}
    return inputs, grad_out, out.detach(), grads


def test_cpu_context_runs_fp8_a_few_percent_from_float64():
    inputs, grad_out, out, grads = run(CONFIG)
    want = reference.dense_float64(CONFIG, 1, *(inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")),
                                   grad_out_TD=[grad_out])
    assert 1e-3 < relative_error(out, want["out_TD"][0]) < 0.12
    for name, key in (("x_TD", "grad_x_TD"), ("scores_TK", "grad_scores_TK"), ("w13", "grad_w13"), ("w2", "grad_w2")):
        assert 1e-3 < relative_error(grads[name].reshape(want[key][0].shape), want[key][0]) < 0.12, name
    _, _, out_bf16, _ = run(dataclasses.replace(CONFIG, gemm_precision="bf16"))
    assert relative_error(out, out_bf16) > 1e-2  # the FP8 path ran, not the BF16 one

