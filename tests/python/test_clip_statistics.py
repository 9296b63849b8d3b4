"""ExecutionOptions(clip_statistics=True): per local expert, the gate inputs the clamped SwiGLU
clipped (above swiglu_limit) and the up inputs (outside [-limit, limit]), counted on h13 as saved
(bf16) over every row of the expert, on every rank and in both balance modes."""

import dataclasses

import pytest
import torch

import poise
from poise import reference

LIMIT = 0.6
CONFIG = poise.Config(num_local_input_tokens=24, hidden_dim=64, intermediate_dim=64, top_k=2, num_experts=8,
                      activation="swiglu_clamped", swiglu_limit=LIMIT)
NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")
CLIPS = poise.ExecutionOptions(clip_statistics=True)


def recount(config, per_rank, ep_size, w13_layout="gate_up_blocked"):
    """The counts from the inputs alone: every (rank, token, k) row's h13 in fp32, rounded to bf16."""
    local = config.num_experts // ep_size
    F = config.intermediate_dim
    want = [torch.zeros(local, 2, dtype=torch.int64) for _ in range(ep_size)]
    for src in range(ep_size):
        x = per_rank["x_TD"][src].float()
        for t, k in torch.cartesian_prod(torch.arange(x.shape[0]), torch.arange(config.top_k)).tolist():
            e = int(per_rank["ids_TK"][src][t, k])
            owner, j = divmod(e, local)
            h13 = (per_rank["w13"][owner].reshape(local, 2 * F, -1)[j].float() @ x[t]).bfloat16().float()
            gate, up = (h13[:F], h13[F:]) if w13_layout == "gate_up_blocked" else (h13[0::2], h13[1::2])
            want[owner][j, 0] += int((gate > LIMIT).sum())
            want[owner][j, 1] += int((up.abs() > LIMIT).sum())
    return want


def close(got, want):
    """Equal up to rows whose h13 sits at the limit (fp32 sums in another order may round across it)."""
    return bool(((got - want).abs() <= want // 100 + 2).all())


@pytest.mark.parametrize("balance", ["exact", "capacity"])
def test_one_rank_context_counts_every_row_and_keeps_the_layer_unchanged(balance):
    config = dataclasses.replace(CONFIG, balance=balance)
    per_rank = reference.random_inputs(config, 1, seed=3)
    inputs = {n: per_rank[n][0].clone().requires_grad_(n != "ids_TK") for n in NAMES}
    with poise.create_context(config=config, device="cpu") as context:
        out, counts = poise.routed_experts(*[inputs[n] for n in NAMES], context, CLIPS)
        out.float().sum().backward()
        plain = {n: per_rank[n][0].clone().requires_grad_(n != "ids_TK") for n in NAMES}
        want_out = poise.routed_experts(*[plain[n] for n in NAMES], context)
        want_out.float().sum().backward()
    assert counts.dtype == torch.int64 and counts.shape == (config.num_experts, 2)
    assert counts.sum() > 0, "the limit should clip something"
    assert close(counts, recount(config, per_rank, 1)[0])
    assert torch.equal(out, want_out)
    for n in ("x_TD", "scores_TK", "w13", "w2"):  # the counts change nothing in forward or backward
        assert torch.equal(inputs[n].grad, plain[n].grad), n


@pytest.mark.parametrize("w13_layout", ["gate_up_blocked", "gate_up_interleaved"])
def test_virtual_ranks_count_replica_rows_for_their_owner(w13_layout):
    ep_size = 4
    per_rank = reference.random_inputs(CONFIG, ep_size, seed=4, routing="one_expert")  # exact balance moves rows
    with poise.create_context(config=CONFIG, device="cpu", ep_size=ep_size, virtual_ranks=True) as context:
        outs, counts = poise.routed_experts_virtual(*[per_rank[n] for n in NAMES], context, CLIPS,
                                                    w13_layout=w13_layout)
    engine = reference.Engine(CONFIG, ep_size)
    engine.forward(*[per_rank[n] for n in NAMES], w13_layout=w13_layout)
    want = recount(CONFIG, per_rank, ep_size, w13_layout)
    assert len(outs) == len(counts) == ep_size
    for r in range(ep_size):
        assert torch.equal(counts[r], engine.clip_counts[r]), r  # the engine is the reference: exactly
        assert close(counts[r], want[r]), r


def test_plain_swiglu_clips_nothing():
    config = dataclasses.replace(CONFIG, activation="swiglu")
    per_rank = reference.random_inputs(config, 1, seed=5)
    with poise.create_context(config=config, device="cpu") as context:
        _, counts = poise.routed_experts(*[per_rank[n][0] for n in NAMES], context, CLIPS)
    assert torch.equal(counts, torch.zeros(config.num_experts, 2, dtype=torch.int64))


def test_opcheck_and_make_fx():
    per_rank = reference.random_inputs(CONFIG, 1, seed=6)
    with poise.create_context(config=CONFIG, device="cpu") as context:
        args = (*[per_rank[n][0] for n in NAMES], context.handle, "gate_up_blocked", False, False)
        torch.library.opcheck(torch.ops.poise.routed_experts_forward_clip_counts.default, args)
        graph = torch.fx.experimental.proxy_tensor.make_fx(
            lambda *t: poise.routed_experts(*t, context, CLIPS), tracing_mode="fake")(*[per_rank[n][0] for n in NAMES])
        assert "routed_experts_forward_clip_counts" in graph.code
