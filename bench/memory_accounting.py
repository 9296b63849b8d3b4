"""What a GPU context really holds on the device against what its memory plan says (one GPU).

For each configuration: poise.plan_memory's total_device_bytes (window + replica experts +
activation slots + device scratch) and Context.device_bytes after one forward+backward (the
pipeline's symmetric workspace and its buffers, per rank). The plan is what users size their
memory by, so the two must agree; tests/python/test_torch_gpu.py checks it at small shapes.

Usage: python3 bench/memory_accounting.py [out.json]   (needs an SM90 GPU and the module built)
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch

import poise
from poise import reference

DEEPSEEK_V3_EP1 = dict(num_local_input_tokens=4096, hidden_dim=7168, intermediate_dim=2048, num_experts=32, top_k=8)
SMALL = dict(num_local_input_tokens=256, hidden_dim=1024, intermediate_dim=512, num_experts=16, top_k=4)
CASES = [
    ("deepseek_v3_ep1_capacity", dict(DEEPSEEK_V3_EP1, balance="capacity"), 1),
    ("deepseek_v3_ep1_exact", dict(DEEPSEEK_V3_EP1, balance="exact"), 1),
    ("small_ep4_exact_virtual", dict(SMALL, balance="exact"), 4),
    ("small_ep2_capacity_virtual_3x", dict(SMALL, balance="capacity", receive_capacity_factor=3.0), 2),
    ("small_ep1_two_slots", dict(SMALL, balance="capacity", num_activation_slots=2), 1),
]


def measure(name: str, fields: dict, ep_size: int, device: torch.device) -> dict:
    config = poise.Config(**fields)
    plan = poise.plan_memory(config, ep_size)
    inputs = reference.random_inputs(config, ep_size, seed=1)
    per_rank = [{n: inputs[n][r].to(device) for n in inputs} for r in range(ep_size)]
    for tensors in per_rank:
        for n in ("x_TD", "scores_TK", "w13", "w2"):
            tensors[n].requires_grad_()
    names = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")
    virtual = ep_size > 1
    with poise.create_context(config=config, device=device, ep_size=ep_size, virtual_ranks=virtual) as context:
        if virtual:
            outs = poise.routed_experts_virtual(*[[t[n] for t in per_rank] for n in names], context)
        else:
            outs = [poise.routed_experts(*[per_rank[0][n] for n in names], context)]
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
        context.check()
        held = context.device_bytes
    planned = plan.total_device_bytes
    return {"name": name, "config": fields, "ep_size": ep_size, "plan_total_device_bytes": planned,
            "device_bytes": held, "held_over_plan": held / planned, "plan": plan.explain()}


def main() -> None:
    out_path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/memory_accounting_h200.json")
    device = torch.device("cuda", torch.cuda.current_device())
    results = [measure(name, fields, ep_size, device) for name, fields, ep_size in CASES]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "results": results}, indent=2) + "\n")
    print(f"{'case':<32}{'plan MiB':>12}{'held MiB':>12}{'held/plan':>11}")
    for r in results:
        print(f"{r['name']:<32}{r['plan_total_device_bytes'] / 2**20:>12.1f}{r['device_bytes'] / 2**20:>12.1f}"
              f"{r['held_over_plan']:>11.3f}")
    for r in results:
        print(f"--- {r['name']}\n{r['plan']}")


if __name__ == "__main__":
    main()
