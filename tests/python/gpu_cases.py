"""What the GPU torch tests share: the layer they run, its inputs, the CPU reference results,
and an allocator poisoned with NaN (so that an output the GPU never writes cannot pass)."""

import dataclasses

import torch

import poise
from poise import reference

TOLERANCE = 1e-2
CONFIG = poise.Config(num_local_input_tokens=128, hidden_dim=256, intermediate_dim=192, top_k=4, num_experts=8)
NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")
BLOCKED, INTERLEAVED = "gate_up_blocked", "gate_up_interleaved"


def relative_error(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all()
    if want.norm() == 0:  # e.g. the weight grads of an expert that received no rows: must be exactly 0
        return got.norm().item()
    return ((got - want).norm() / want.norm()).item()


def inputs_on(device, seed=0, routing="uniform", ep_size=1, free_fraction=0.0):
    per_rank = reference.random_inputs(CONFIG, ep_size, seed=seed, routing=routing, free_fraction=free_fraction)
    return [{name: per_rank[name][r].to(device) for name in NAMES} for r in range(ep_size)]


def cpu_result(inputs, grad_out_TD):
    """out and (grad_x, grad_scores, grad_w13, grad_w2) from a CPU context (the reference engine)."""
    leaves = {n: inputs[n].detach().cpu().requires_grad_(n != "ids_TK") for n in NAMES}
    with poise.create_context(config=CONFIG, device="cpu") as context:
        out = poise.routed_experts(*[leaves[n] for n in NAMES], context)
        out.backward(grad_out_TD.cpu())
    return out.detach(), [leaves[n].grad for n in ("x_TD", "scores_TK", "w13", "w2")]


GPT_OSS = dataclasses.replace(CONFIG, activation="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0)
BIASED_NAMES = NAMES + ("b13", "b2")
DIFFERENTIABLE = ("x_TD", "scores_TK", "w13", "w2", "b13", "b2")


def biased_inputs_on(device, seed=0, routing="uniform", free_fraction=0.0, weights_transposed=False, ep_size=1):
    """inputs_on's layer (per rank) plus expert biases b13 [E_local, 2F], b2 [E_local, D] (bf16,
    about the size of an expert's output), the weights stored for x @ W with ``weights_transposed``."""
    local, F, D = CONFIG.num_experts // ep_size, CONFIG.intermediate_dim, CONFIG.hidden_dim
    generator = torch.Generator().manual_seed(seed + 1000)
    per_rank = inputs_on(device, seed=seed, routing=routing, ep_size=ep_size, free_fraction=free_fraction)
    for inputs in per_rank:
        inputs["b13"] = (torch.randn(local, 2 * F, generator=generator) * 0.5).bfloat16().to(device)
        inputs["b2"] = (torch.randn(local, D, generator=generator) * 0.5).bfloat16().to(device)
        if weights_transposed:
            for name in ("w13", "w2"):
                inputs[name] = inputs[name].transpose(1, 2).contiguous()
    return per_rank


def flip_weight(t, name, weights_transposed):
    """With weights_transposed, a weight or its grad (w13, w2) in the other layout ([E_local, D, 2F]
    <-> [E_local, 2F, D], [E_local, F, D] <-> [E_local, D, F]), as a view; anything else as it is."""
    return t.transpose(1, 2) if weights_transposed and name in ("w13", "w2") else t


def cpu_biased_result(config, inputs, grad_out_TD, w13_layout, weights_transposed):
    """out and the grads of DIFFERENTIABLE (in the inputs' layout) from a CPU context given the weights
    in the plain layout: a reference that does not go through weights_transposed at all."""
    leaves = {n: flip_weight(inputs[n].detach().cpu(), n, weights_transposed).contiguous()
              .requires_grad_(n != "ids_TK") for n in BIASED_NAMES}
    with poise.create_context(config=config, device="cpu") as context:
        out = poise.routed_experts(*[leaves[n] for n in NAMES], context, w13_layout=w13_layout, b13=leaves["b13"],
                                   b2=leaves["b2"])
        out.backward(grad_out_TD.cpu())
    return out.detach(), {n: flip_weight(leaves[n].grad, n, weights_transposed) for n in DIFFERENTIABLE}


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
