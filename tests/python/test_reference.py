"""poise.reference from PyTorch: the C++ CPU engine over virtual ranks (R = 1, 2, 4, 8) against two
independent float64 oracles, the C++ dense loops and a plain PyTorch implementation (autograd)."""

import pytest
import torch

import poise
from poise import reference

TOLERANCE = 1e-2  # ||got - want|| / ||want|| for bf16 quantities against float64


def make_config(**changes) -> poise.Config:
    fields = dict(num_local_input_tokens=24, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=8)
    return poise.Config(**{**fields, **changes})


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert got.shape == want.shape
    assert torch.isfinite(got).all(), "NaN/inf in the engine's output"
    if want.norm() == 0:  # e.g. the weight grads of experts no token picked
        return 0.0 if (got == 0).all() else float("inf")
    return ((got - want).norm() / want.norm()).item()


def torch_oracle(config, ep_size, inputs, grad_out_TD, w13_layout="gate_up_blocked"):
    """float64 autograd through reference.routed_experts_torch over the global experts."""
    leaf = lambda ts: [t.detach().double().requires_grad_() for t in ts]
    x, scores, w13, w2 = leaf(inputs["x_TD"]), leaf(inputs["scores_TK"]), leaf(inputs["w13"]), leaf(inputs["w2"])
    w13_E2FD, w2_EDF = reference.global_experts(w13, w2, config)
    outs = [reference.routed_experts_torch(x[r], inputs["ids_TK"][r], scores[r], w13_E2FD, w2_EDF, config,
                                           w13_layout=w13_layout) for r in range(ep_size)]
    torch.autograd.backward(outs, [g.double() for g in grad_out_TD])
    return dict(out_TD=outs, grad_x_TD=[t.grad for t in x], grad_scores_TK=[t.grad for t in scores],
                grad_w13=[t.grad for t in w13], grad_w2=[t.grad for t in w2])


def run_engine(config, ep_size, inputs, grad_out_TD, w13_layout="gate_up_blocked"):
    engine = reference.Engine(config, ep_size)
    out = engine.forward(**inputs, w13_layout=w13_layout)
    grads = engine.backward(grad_out_TD)
    return engine, dict(out_TD=out, grad_x_TD=[g.grad_x_TD for g in grads],
                        grad_scores_TK=[g.grad_scores_TK for g in grads],
                        grad_w13=[g.grad_w13 for g in grads], grad_w2=[g.grad_w2 for g in grads])


def grad_outs(config, ep_size, seed=7):
    generator = torch.Generator().manual_seed(seed)
    T, D = config.num_local_input_tokens, config.hidden_dim
    return [torch.randn(T, D, generator=generator).bfloat16() for _ in range(ep_size)]


def assert_matches(got, want, tolerance=TOLERANCE):
    for name, want_per_rank in want.items():
        for r, (g, w) in enumerate(zip(got[name], want_per_rank)):
            error = relative_error(g, w.reshape(g.shape))
            assert error < tolerance, f"{name} rank {r}: relative error {error:.2e}"


CASES = {
    # name: (config changes, ep_size, random_inputs options)
    "R1": (dict(), 1, dict()),
    "R2-D192-F192": (dict(hidden_dim=192, intermediate_dim=192), 2, dict()),  # multiples of 64, not of 128
    "R4-K4-bf16-scores": (dict(top_k=4, num_experts=16), 4, dict(scores_dtype=torch.bfloat16)),
    "R8-K3": (dict(top_k=3, num_experts=16, num_local_input_tokens=16), 8, dict()),
    "R4-one-expert": (dict(top_k=2), 4, dict(routing="one_expert")),
    "R4-first-rank": (dict(top_k=2), 4, dict(routing="first_rank")),  # 3 ranks' experts get no rows
    "R2-K1-all-to-expert-0": (dict(top_k=1, num_experts=4), 2, dict(routing="one_expert")),
    "R2-padding-rows": (dict(), 2, dict(padding_rows=5)),
    "R2-capacity": (dict(balance="capacity", receive_capacity_factor=4.0), 2, dict(routing="first_rank")),
    "R2-clamped": (dict(activation="swiglu_clamped", swiglu_limit=0.25, swiglu_alpha=1.702), 2, dict()),
    "R2-w13-E2_F_D": (dict(), 2, dict(w13_shape="E2_F_D")),
    "R2-w13-flat": (dict(), 2, dict(w13_shape="flat")),
    "R1-wgrad-bf16": (dict(wgrad_dtype="bf16"), 1, dict()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_matches_both_float64_oracles(case):
    changes, ep_size, options = CASES[case]
    config = make_config(**changes)
    inputs = reference.random_inputs(config, ep_size, seed=len(case), **options)
    grad_out = grad_outs(config, ep_size)
    _, got = run_engine(config, ep_size, inputs, grad_out)
    assert_matches(got, torch_oracle(config, ep_size, inputs, grad_out))
    assert_matches(got, reference.dense_float64(config, ep_size, **inputs, grad_out_TD=grad_out))
    # Shapes and dtypes follow the inputs; weight grads come in Config.wgrad_dtype.
    wgrad = torch.bfloat16 if config.wgrad_dtype == "bf16" else torch.float32
    for r in range(ep_size):
        assert got["out_TD"][r].dtype == got["grad_x_TD"][r].dtype == torch.bfloat16
        assert got["grad_scores_TK"][r].dtype == inputs["scores_TK"][r].dtype
        assert got["grad_w13"][r].shape == inputs["w13"][r].shape and got["grad_w13"][r].dtype == wgrad
        assert got["grad_w2"][r].shape == inputs["w2"][r].shape and got["grad_w2"][r].dtype == wgrad
    if options.get("padding_rows"):
        padding = slice(config.num_local_input_tokens - options["padding_rows"], None)
        for r in range(ep_size):
            assert (got["out_TD"][r][padding] == 0).all() and (got["grad_x_TD"][r][padding] == 0).all()


def test_clamped_case_really_clamps():
    """The swiglu_clamped case above is only a test of the clamp if some inputs cross the limit."""
    changes, ep_size, options = CASES["R2-clamped"]
    config = make_config(**changes)
    inputs = reference.random_inputs(config, ep_size, seed=len("R2-clamped"), **options)
    w13_E2FD, _ = reference.global_experts(inputs["w13"], inputs["w2"], config)
    h = torch.einsum("td,efd->tef", inputs["x_TD"][0].double(), w13_E2FD.double())
    assert (h.abs() > config.swiglu_limit).float().mean() > 0.2


def test_interleaved_w13_layout():
    config = make_config()
    inputs = reference.random_inputs(config, 2, seed=3)
    grad_out = grad_outs(config, 2)
    _, got = run_engine(config, 2, inputs, grad_out, w13_layout="gate_up_interleaved")
    assert_matches(got, torch_oracle(config, 2, inputs, grad_out, w13_layout="gate_up_interleaved"))
    # Not the blocked result: the layout argument reaches the engine.
    _, blocked = run_engine(config, 2, inputs, grad_out)
    assert relative_error(got["out_TD"][0], blocked["out_TD"][0].double()) > 0.1


def test_the_two_oracles_agree_to_float64_precision():
    config = make_config(activation="swiglu_clamped", swiglu_limit=0.5)
    inputs = reference.random_inputs(config, 2, seed=11)
    grad_out = grad_outs(config, 2)
    dense = reference.dense_float64(config, 2, **inputs, grad_out_TD=grad_out)
    plain = torch_oracle(config, 2, inputs, grad_out)
    for name, per_rank in plain.items():
        for got, want in zip(dense[name], per_rank):
            assert ((got - want.reshape(got.shape)).norm() / want.norm()).item() < 1e-12, name


def test_exact_balance_evens_out_skewed_routing():
    config = make_config(top_k=2, num_experts=8)
    inputs = reference.random_inputs(config, 4, seed=5, routing="first_rank")
    engine = reference.Engine(config, 4)
    engine.forward(**inputs)
    stats = engine.routing_stats
    rows = config.num_local_input_tokens * config.top_k
    assert list(stats.owner_rows) == [4 * rows, 0, 0, 0]
    assert list(stats.computed_rows) == [rows] * 4
    assert stats.computed_peak_over_mean() == 1.0 and stats.owner_peak_over_mean() == 4.0


def test_exact_and_capacity_balance_give_the_same_result():
    inputs = reference.random_inputs(make_config(), 4, seed=9, routing="one_expert")
    grad_out = grad_outs(make_config(), 4)
    _, exact = run_engine(make_config(), 4, inputs, grad_out)
    _, capacity = run_engine(make_config(balance="capacity", receive_capacity_factor=4.0), 4, inputs, grad_out)
    # Equal up to fp32 summation order (replica weight grads are reduced in another order).
    assert_matches(exact, {name: [t.double() for t in ts] for name, ts in capacity.items()}, tolerance=2e-3)


def test_capacity_overflow_is_reported_not_dropped():
    config = make_config(balance="capacity", receive_capacity_factor=1.0)
    inputs = reference.random_inputs(config, 4, seed=1, routing="first_rank")
    with pytest.raises(poise.DeviceError, match="receive capacity"):
        reference.Engine(config, 4).forward(**inputs)


@pytest.mark.parametrize("wgrad_dtype", ["fp32", "bf16"])
def test_accumulate_into_adds_in_place(wgrad_dtype):
    config = make_config(wgrad_dtype=wgrad_dtype)
    dtype = torch.float32 if wgrad_dtype == "fp32" else torch.bfloat16
    inputs = reference.random_inputs(config, 2, seed=2)
    grad_out = grad_outs(config, 2)
    engine, plain = run_engine(config, 2, inputs, grad_out)
    existing = [(torch.randn(w13.shape).to(dtype), torch.randn(w2.shape).to(dtype))
                for w13, w2 in zip(inputs["w13"], inputs["w2"])]
    before = [(a.clone(), b.clone()) for a, b in existing]
    grads = engine.backward(grad_out, accumulate_into=existing)
    for r in range(2):
        assert grads[r].grad_w13 is existing[r][0] and grads[r].grad_w2 is existing[r][1]  # in place
        want13 = before[r][0].double() + plain["grad_w13"][r].double()
        want2 = before[r][1].double() + plain["grad_w2"][r].double()
        tolerance = 1e-7 if dtype == torch.float32 else 1e-2
        assert relative_error(existing[r][0], want13) < tolerance
        assert relative_error(existing[r][1], want2) < tolerance


def test_engine_validation_names_the_argument():
    config = make_config()
    inputs = reference.random_inputs(config, 2, seed=4)
    engine = reference.Engine(config, 2)

    def raises(name, **changes):
        with pytest.raises(poise.InvalidArgument) as raised:
            engine.forward(**{**inputs, **changes})
        assert raised.value.name == name, raised.value
        return raised.value

    raises("x_TD", x_TD=inputs["x_TD"][:1])  # one rank missing
    error = raises("x_TD", x_TD=[inputs["x_TD"][0], inputs["x_TD"][1].float()])
    assert "rank 1" in str(error)
    raises("ids_TK", ids_TK=[i.long() for i in inputs["ids_TK"]])
    bad_ids = [i.clone() for i in inputs["ids_TK"]]
    bad_ids[1][3, 0] = config.num_experts
    assert "out of range" in str(raises("ids_TK", ids_TK=bad_ids))
    twice = [i.clone() for i in inputs["ids_TK"]]
    twice[0][2, 1] = twice[0][2, 0]
    assert "twice" in str(raises("ids_TK", ids_TK=twice))
    raises("scores_TK", scores_TK=[inputs["scores_TK"][0], inputs["scores_TK"][1].bfloat16()])
    raises("w13", w13=[w[:, :-1] for w in inputs["w13"]])
    raises("w13_layout", w13_layout="gate_up_mixed")
    with pytest.raises(poise.InvalidArgument) as raised:
        reference.Engine(config, 2).backward(grad_outs(config, 2))
    assert raised.value.name == "grad_out_TD"
    with pytest.raises(poise.InvalidArgument) as raised:
        reference.Engine(config, 3)
    assert raised.value.name == "num_experts"
