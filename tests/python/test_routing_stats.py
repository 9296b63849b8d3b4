"""Routing telemetry (Context.routing_stats, poise.plot_routing) on CPU contexts: the counts of the
latest forward, before and after balancing, free entries (id -1) excluded; the plot's PNG."""

import pytest
import torch

import poise
from poise import reference

CONFIG = poise.Config(num_local_input_tokens=48, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=8)


def names_of(inputs, rank):
    return [inputs[n][rank] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]


def test_one_rank_counts_the_routed_rows_only():
    inputs = reference.random_inputs(CONFIG, 1, seed=3, free_fraction=0.3)
    ids = inputs["ids_TK"][0]
    with poise.create_context(config=CONFIG, device="cpu") as context:
        with pytest.raises(poise.InvalidArgument) as raised:
            context.routing_stats()
        assert raised.value.name == "context"
        with torch.no_grad():
            poise.routed_experts(*names_of(inputs, 0), context)
        stats = context.routing_stats()
    routed = ids[ids >= 0].long()
    assert torch.equal(stats.expert_rows, torch.bincount(routed, minlength=8).int())
    assert stats.owner_rows.tolist() == stats.computed_rows.tolist() == [routed.numel()]
    assert stats.replicas.tolist() == [0]
    assert stats.received_token_rows.item() == int((ids >= 0).any(dim=1).sum())  # tokens with a routed entry
    assert stats.received_bytes.item() == stats.received_token_rows.item() * 2 * CONFIG.hidden_dim
    assert stats.owner_peak_over_mean.item() == 1.0


def test_virtual_ranks_show_the_balance_plan():
    """Every token picks among rank 0's experts: 4x the mean before balancing, even after."""
    config = poise.Config(**{**CONFIG.__dict__, "balance": "exact"})
    inputs = reference.random_inputs(config, 4, seed=5, routing="first_rank")
    with poise.create_context(config=config, device="cpu", ep_size=4, virtual_ranks=True) as context:
        with torch.no_grad():
            poise.routed_experts_virtual(*[inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")], context)
        per_rank = context.routing_stats()
    assert len(per_rank) == 4
    C = config.num_local_input_tokens * config.top_k
    for rank, stats in enumerate(per_rank):
        assert torch.equal(stats.expert_rows, per_rank[0].expert_rows)
        assert stats.owner_rows.tolist() == [4 * C, 0, 0, 0]
        assert stats.computed_rows.tolist() == [C] * 4
        assert stats.replicas[1:].min().item() >= 1 and stats.replicas[0].item() == 0
        assert stats.owner_peak_over_mean.item() == 4.0 and stats.computed_peak_over_mean.item() == 1.0
        assert stats.received_token_rows.item() > 0
    # Every token crosses to at least one rank, and a token row crosses at most once per routed row.
    received = sum(stats.received_token_rows.item() for stats in per_rank)
    assert 4 * config.num_local_input_tokens <= received <= 4 * C


@pytest.mark.parametrize("link_gb_per_s, balanced", [(1e9, True), (1e-3, False)])
def test_the_cost_aware_plan_moves_rows_only_where_the_link_pays(link_gb_per_s, balanced):
    """A hot expert on rank 0 (1.5x the mean): with a free link the cost-aware plan balances every
    rank to T*K as exact balance does; with a dear one no replica pays and every row stays home
    (the receive rows hold receive_capacity_factor * T*K)."""
    config = poise.Config(**{**CONFIG.__dict__, "balance": "exact", "balance_cost_ns_per_row": 400.0,
                             "balance_link_gb_per_s": link_gb_per_s})
    inputs = reference.random_inputs(config, 4, seed=6)
    C = config.num_local_input_tokens * config.top_k
    for rank in range(4):  # half the tokens of every rank pick expert 0 first: rank 0 holds ~1.5 C rows
        ids = inputs["ids_TK"][rank]
        for t in range(0, config.num_local_input_tokens, 2):
            if 0 not in ids[t].tolist():
                ids[t, 0] = 0
    with poise.create_context(config=config, device="cpu", ep_size=4, virtual_ranks=True) as context:
        with torch.no_grad():
            poise.routed_experts_virtual(*[inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")], context)
        stats = context.routing_stats()[0]
    assert stats.owner_rows[0].item() > C
    if balanced:
        assert stats.computed_rows.tolist() == [C] * 4 and stats.replicas.sum().item() > 0
    else:
        assert torch.equal(stats.computed_rows, stats.owner_rows) and stats.replicas.sum().item() == 0


def test_plot_routing_writes_a_png(tmp_path):
    history = []
    with poise.create_context(config=CONFIG, device="cpu") as first, \
         poise.create_context(config=CONFIG, device="cpu") as second:
        for step in range(3):
            row = []
            for layer, context in enumerate((first, second)):
                inputs = reference.random_inputs(CONFIG, 1, seed=10 * step + layer, routing="one_expert")
                with torch.no_grad():
                    poise.routed_experts(*names_of(inputs, 0), context)
                row.append(context.routing_stats())
            history.append(row)
    path = poise.plot_routing(history, tmp_path / "routing.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.plot_routing([history[0], history[1][:1]], tmp_path / "bad.png")
    assert raised.value.name == "history"


def test_every_entry_free_gives_zero_rows_and_zero_peak_over_mean():
    inputs = reference.random_inputs(CONFIG, 1, seed=9, free_fraction=1.0)
    with poise.create_context(config=CONFIG, device="cpu") as context:
        with torch.no_grad():
            out = poise.routed_experts(*names_of(inputs, 0), context)
        stats = context.routing_stats()
    assert not out.float().any()
    assert stats.expert_rows.sum().item() == 0 and stats.received_token_rows.item() == 0
    assert stats.owner_peak_over_mean.item() == 0.0 and stats.received_bytes.item() == 0
