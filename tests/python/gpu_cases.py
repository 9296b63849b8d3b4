"""What the GPU torch tests share: the layer they run, its inputs, the CPU reference results,
and an allocator poisoned with NaN (so that an output the GPU never writes cannot pass)."""

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
