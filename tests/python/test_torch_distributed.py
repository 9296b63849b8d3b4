"""A CPU context over a torch.distributed group (gloo, 2 processes under torchrun) gives exactly what
the virtual-rank reference gives for the same inputs: the group path is the same engine, fed by
all-gathers."""

import subprocess
import sys

import pytest
import torch

WORKER = r"""
import os
import torch
import torch.distributed as dist
import poise
from poise import reference

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
config = poise.Config(num_local_input_tokens=16, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=4)
everyone = reference.random_inputs(config, world, seed=5, routing="one_expert")  # same on every process
grad_outs = [torch.randn(16, 128, generator=torch.Generator().manual_seed(r)).bfloat16() for r in range(world)]

mine = {name: values[rank].clone() for name, values in everyone.items()}
for name in ("x_TD", "scores_TK", "w13", "w2"):
    mine[name].requires_grad_()
with poise.create_context(config=config, group=dist.group.WORLD, device="cpu") as context:
    assert (context.ep_size, context.rank) == (world, rank)
    out = poise.routed_experts(mine["x_TD"], mine["ids_TK"], mine["scores_TK"], mine["w13"], mine["w2"], context)
    out.backward(grad_outs[rank])

engine = reference.Engine(config, world)
want_out = engine.forward(**everyone)[rank]
want = engine.backward(grad_outs)[rank]
assert torch.equal(out, want_out), "out_TD"
assert torch.equal(mine["x_TD"].grad, want.grad_x_TD), "grad_x_TD"
assert torch.equal(mine["scores_TK"].grad, want.grad_scores_TK), "grad_scores_TK"
assert torch.equal(mine["w13"].grad, want.grad_w13.bfloat16()), "grad_w13"
assert torch.equal(mine["w2"].grad, want.grad_w2.bfloat16()), "grad_w2"
print(f"rank {rank} of {world}: matches the virtual-rank reference", flush=True)
dist.barrier()  # both ranks done with the group before either tears it down (gloo may abort otherwise)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_cpu_group_context_matches_virtual_ranks(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        assert f"rank {rank} of 2: matches the virtual-rank reference" in result.stdout
