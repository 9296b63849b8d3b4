"""gemm_precision='fp8_block_scaled' on GPU contexts (docs/fp8.md; run on a device machine: pytest -m
gpu): the forward quantizes each call's weights, x rows and SwiGLU output and runs FP8 GEMMs, and
equals a CPU context's forward (the reference engine, same config, same quantization) up to fp32
summation order, a few percent from the BF16 result; autograd's backward (FP8 DGRAD and WGRAD GEMMs)
equals a CPU context's FP8 backward up to summation order; the call options the FP8 GEMMs do not
take are refused by name. (The plan's fp8_operand_bytes, which needs no GPU: test_plan.py.)"""

import dataclasses

import pytest
import torch

import poise
from poise import reference
from gpu_cases import NAMES, poison_allocator, relative_error

pytestmark = pytest.mark.gpu

# D and F 64 mod 128: the last scale block of x, a and the weights is 64 wide.
CONFIG = poise.Config(num_local_input_tokens=96, hidden_dim=192, intermediate_dim=320, top_k=4, num_experts=8,
                      swiglu_limit=1.5, gemm_precision="fp8_block_scaled")
# GPU against the CPU FP8 reference: the same quantized operands, sums in another order (measured:
# 2.4e-3 - 6e-3; an element up to 0.058 x (|want| + row rms) where a flips one E4M3 step:
# tests/gpu/test_context_fp8.cpp).
OUT_REL_L2 = 1.5e-2
ELEMENT = 0.1  # |got - want| <= ELEMENT * (|want| + rms of want's row)
# FP8 against BF16 on these inputs: the CPU engines differ by 5.8% - 6.5% (tests/gpu/test_context_fp8.cpp).
FP8_GAP = (4e-2, 9e-2)


def device():
    return torch.device("cuda", torch.cuda.current_device())


def cpu_out(config, ep_size, per_rank):
    """Every rank's out_TD from the CPU reference engine (a CPU context's for one rank)."""
    if ep_size == 1:
        with poise.create_context(config=config, device="cpu") as context, torch.no_grad():
            return [poise.routed_experts(*[per_rank[0][n].cpu() for n in NAMES], context)]
    engine = reference.Engine(config, ep_size)
    return engine.forward(**{n: [inputs[n].cpu() for inputs in per_rank] for n in NAMES})


def assert_out_matches(got, config, ep_size, per_rank, label):
    """got (per rank) against the CPU FP8 reference (OUT_REL_L2, every element within ELEMENT of
    |want| + its row's rms) and the CPU BF16 reference (FP8_GAP); prints the numbers."""
    want = cpu_out(config, ep_size, per_rank)
    want_bf16 = cpu_out(dataclasses.replace(config, gemm_precision="bf16"), ep_size, per_rank)
    for r in range(ep_size):
        g, w = got[r].double().cpu(), want[r].double()
        error, gap = relative_error(g, w), relative_error(g, want_bf16[r])
        bound = ELEMENT * (w.abs() + w.pow(2).mean(dim=1, keepdim=True).sqrt())
        ratio = ((g - w).abs() / bound.clamp_min(1e-30)).max().item() * ELEMENT
        print(f"[fp8] {label} rank {r}: out vs FP8 reference {error:.3e} rel L2 (worst element {ratio:.4f} of "
              f"|want| + row rms), vs BF16 reference {gap:.3e}")
        assert error < OUT_REL_L2, (label, r, error)
        outside = int(((g - w).abs() > bound).sum())
        assert outside == 0, f"{label} rank {r}: {outside} elements beyond {ELEMENT} x (|want| + row rms)"
        assert FP8_GAP[0] < gap < FP8_GAP[1], (label, r, gap)


def one_rank_inputs(config, seed, routing="uniform"):
    generated = reference.random_inputs(config, 1, seed=seed, routing=routing, padding_rows=3)
    return [{n: generated[n][0].to(device()) for n in NAMES}]


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped"])
@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
def test_one_rank_forward_matches_a_cpu_context(activation, routing):
    """poise.routed_experts on a GPU context against a CPU context of the same config, twice on one
    context (other weights the second time: each call quantizes its own), and the bytes the context
    holds against its plan (FP8 operands included)."""
    config = dataclasses.replace(CONFIG, activation=activation)
    with poise.create_context(config=config, device=device()) as context:
        for seed in (30, 31):
            per_rank = one_rank_inputs(config, seed, routing)
            poison_allocator(device(), [per_rank[0]["x_TD"]])
            with torch.no_grad():
                out = poise.routed_experts(*[per_rank[0][n] for n in NAMES], context)
            context.check()
            assert_out_matches([out], config, 1, per_rank, f"R1 {activation} {routing} seed {seed}")
        held, planned = context.device_bytes, context.plan.total_device_bytes
        assert context.plan.fp8_operand_bytes > 0
    mib = 1 << 20
    assert held <= planned * 1.01 + mib, (held, planned)
    assert held >= planned * 0.9 - 4 * mib, (held, planned)


@pytest.mark.parametrize("ep_size, balance, activation", [
    (2, "exact", "swiglu_clamped"), (4, "exact", "swiglu"), (4, "capacity", "swiglu_clamped")])
def test_virtual_ranks_forward_matches_the_reference_engine(ep_size, balance, activation):
    """poise.routed_experts_virtual with a hot expert (every token picks expert 0: exact balance
    replicates it) against the CPU reference engine in FP8 mode."""
    config = dataclasses.replace(CONFIG, num_experts=4 * ep_size, balance=balance, activation=activation,
                                 receive_capacity_factor=float(ep_size))
    generated = reference.random_inputs(config, ep_size, seed=40 + ep_size, routing="one_expert", padding_rows=3)
    per_rank = [{n: generated[n][r].to(device()) for n in NAMES} for r in range(ep_size)]
    with poise.create_context(config=config, device=device(), ep_size=ep_size, virtual_ranks=True) as context:
        poison_allocator(device(), [inputs["x_TD"] for inputs in per_rank])
        with torch.no_grad():
            outs = poise.routed_experts_virtual(*[[inputs[n] for inputs in per_rank] for n in NAMES], context)
        context.check()
    assert_out_matches(outs, config, ep_size, per_rank, f"R{ep_size} {balance} {activation}")


# Gradients against the CPU FP8 reference: the same quantized operands, sums in another order
# (tests/gpu/test_context_fp8.cpp: kGradRelL2); against the BF16 reference FP8's own error.
GRAD_REL_L2 = 1.5e-2
FP8_GRAD_GAP = 0.15
GRAD_NAMES = ("x_TD", "scores_TK", "w13", "w2")


def autograd_grads(config, dev, inputs, grad_out):
    """out_TD and the gradients of x_TD, scores_TK, w13 and w2 from one forward + backward on a fresh
    context of config on dev."""
    leaves = {n: t.to(dev).clone().requires_grad_(n in GRAD_NAMES) for n, t in inputs.items()}
    with poise.create_context(config=config, device=dev) as context:
        out = poise.routed_experts(*[leaves[n] for n in NAMES], context)
        out.backward(grad_out.to(dev))
        context.check()
    return out.detach().cpu(), {n: leaves[n].grad.cpu() for n in GRAD_NAMES}


def per_expert_error(got, want):
    """The worst expert's relative L2 for weight gradients, the tensor's for the others."""
    if got.dim() == 3:
        return max(relative_error(g, w) for g, w in zip(got, want))
    return relative_error(got, want)


@pytest.mark.parametrize("fp8_wgrad", [False, True], ids=["bf16_wgrad", "fp8_wgrad"])
@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
def test_one_rank_backward_matches_a_cpu_context(routing, fp8_wgrad):
    """torch autograd through a GPU FP8 context, WGRAD in BF16 or FP8 (Config.fp8_wgrad): every
    gradient (weights per expert) against a CPU context's FP8 backward (GRAD_REL_L2) and a CPU BF16
    context's (FP8_GRAD_GAP)."""
    config = dataclasses.replace(CONFIG, fp8_wgrad=fp8_wgrad)
    inputs = one_rank_inputs(config, seed=50, routing=routing)[0]
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim, generator=torch.Generator().manual_seed(5))
    grad_out = grad_out.bfloat16()
    poison_allocator(device(), [inputs["x_TD"]])
    _, got = autograd_grads(config, device(), inputs, grad_out)
    _, want = autograd_grads(config, "cpu", inputs, grad_out)
    _, want_bf16 = autograd_grads(dataclasses.replace(config, gemm_precision="bf16", fp8_wgrad=False), "cpu", inputs,
                                  grad_out)
    for name in GRAD_NAMES:
        error, gap = per_expert_error(got[name], want[name]), per_expert_error(got[name], want_bf16[name])
        print(f"[fp8] R1 {routing} {'fp8' if fp8_wgrad else 'bf16'} WGRAD grad of {name}: vs FP8 reference "
              f"{error:.3e} rel L2, vs BF16 reference {gap:.3e}")
        assert error < GRAD_REL_L2, (name, error)
        assert gap < FP8_GRAD_GAP, (name, gap)


def test_call_options_the_fp8_gemms_do_not_take_are_refused_by_name():
    """Interleaved W13, transposed weights and expert biases: poise.NotAvailable naming the argument
    (and gemm_precision) before any kernel; the plain call then runs right on the same context."""
    per_rank = one_rank_inputs(CONFIG, seed=60, routing="one_expert")
    inputs = per_rank[0]
    local, F, D = CONFIG.num_experts, CONFIG.intermediate_dim, CONFIG.hidden_dim
    b13 = torch.zeros(local, 2 * F, device=device()).bfloat16()
    b2 = torch.zeros(local, D, device=device()).bfloat16()
    transposed = {**inputs, "w13": inputs["w13"].transpose(1, 2).contiguous(),
                  "w2": inputs["w2"].transpose(1, 2).contiguous()}
    calls = [
        ("w13_layout", inputs, dict(w13_layout="gate_up_interleaved")),
        ("weights_transposed", transposed, dict(weights_transposed=True)),
        ("b13", inputs, dict(b13=b13, b2=b2)),
    ]
    with poise.create_context(config=CONFIG, device=device()) as context, torch.no_grad():
        for name, tensors, options in calls:
            with pytest.raises(poise.NotAvailable) as raised:
                poise.routed_experts(*[tensors[n] for n in NAMES], context, **options)
            assert f"args[0].{name}" in str(raised.value) and "gemm_precision" in str(raised.value), str(raised.value)
        context.check()
        out = poise.routed_experts(*[inputs[n] for n in NAMES], context)
        context.check()
    assert_out_matches([out], CONFIG, 1, per_rank, "after the refused options")
