"""poise.routed_experts_virtual on a CPU virtual-ranks context (the reference engine behind the
same ops, fake implementations and autograd the GPU path uses), against plain PyTorch in float64.

The GPU path of the same API is tested in test_torch_gpu_virtual.py (device only)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import poise
from poise import reference

CONFIG = poise.Config(num_local_input_tokens=24, hidden_dim=64, intermediate_dim=128, top_k=3, num_experts=8)
NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")
GRAD_NAMES = ("x_TD", "scores_TK", "w13", "w2")


def relative_error(got, want) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all()
    return ((got - want).norm() / want.norm()).item()


def leaves_of(inputs):
    return {n: [t.clone().requires_grad_(n != "ids_TK") for t in inputs[n]] for n in NAMES}


def float64_oracle(inputs, grad_out_TD, config=CONFIG):
    """Per rank out_TD and grads, from reference.routed_experts_torch over the global experts."""
    ranks = len(inputs["x_TD"])
    w13_E2FD, w2_EDF = (w.double().requires_grad_() for w in reference.global_experts(inputs["w13"], inputs["w2"], config))
    outs, grad_x, grad_scores = [], [], []
    for r in range(ranks):
        x = inputs["x_TD"][r].double().requires_grad_()
        scores = inputs["scores_TK"][r].double().requires_grad_()
        out = reference.routed_experts_torch(x, inputs["ids_TK"][r], scores, w13_E2FD, w2_EDF, config)
        out.backward(grad_out_TD[r].double())
        outs.append(out.detach())
        grad_x.append(x.grad)
        grad_scores.append(scores.grad)
    L = config.num_experts // ranks
    return outs, {"x_TD": grad_x, "scores_TK": grad_scores,
                  "w13": list(w13_E2FD.grad.split(L)), "w2": list(w2_EDF.grad.split(L))}


@pytest.mark.parametrize("ep_size", [1, 2, 4, 8])
@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
def test_forward_and_backward_match_float64(ep_size, routing):
    inputs = reference.random_inputs(CONFIG, ep_size, seed=ep_size, routing=routing)
    leaves = leaves_of(inputs)
    grad_out = [torch.randn(CONFIG.num_local_input_tokens, CONFIG.hidden_dim).bfloat16() for _ in range(ep_size)]
    with poise.create_context(config=CONFIG, device="cpu", ep_size=ep_size, virtual_ranks=True) as context:
        outs = poise.routed_experts_virtual(*[leaves[n] for n in NAMES], context)
        assert len(outs) == ep_size and all(o.dtype == torch.bfloat16 for o in outs)
        torch.autograd.backward(outs, grad_out)
    want_outs, want_grads = float64_oracle(inputs, grad_out)
    for r in range(ep_size):
        assert relative_error(outs[r], want_outs[r]) < 1e-2, r
        for name in GRAD_NAMES:
            got = leaves[name][r].grad.reshape(want_grads[name][r].shape)
            assert relative_error(got, want_grads[name][r]) < 1e-2, (r, name)


def test_a_rank_whose_output_is_unused_still_gets_its_grads():
    """Backward is collective: rank 0's tokens reach rank 1's experts even if rank 1's out is unused."""
    inputs = reference.random_inputs(CONFIG, 2, seed=11)
    leaves = leaves_of(inputs)
    with poise.create_context(config=CONFIG, device="cpu", ep_size=2, virtual_ranks=True) as context:
        outs = poise.routed_experts_virtual(*[leaves[n] for n in NAMES], context)
        grad0 = torch.randn_like(outs[0])
        outs[0].backward(grad0)
    _, want = float64_oracle(inputs, [grad0, torch.zeros_like(grad0)])
    assert relative_error(leaves["w13"][1].grad, want["w13"][1].reshape(leaves["w13"][1].shape)) < 1e-2
    assert leaves["x_TD"][1].grad.abs().max() == 0  # no grad flows into rank 1's own tokens


def test_only_some_inputs_require_grad():
    inputs = reference.random_inputs(CONFIG, 2, seed=12)
    x = [t.clone().requires_grad_() for t in inputs["x_TD"]]
    with poise.create_context(config=CONFIG, device="cpu", ep_size=2, virtual_ranks=True) as context:
        outs = poise.routed_experts_virtual(x, inputs["ids_TK"], inputs["scores_TK"], inputs["w13"], inputs["w2"],
                                            context)
        sum(o.float().sum() for o in outs).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in x)


def test_backward_of_an_older_forward_recomputes_it():
    layers = [reference.random_inputs(CONFIG, 2, seed=s) for s in (13, 14)]
    leaves = [leaves_of(inputs) for inputs in layers]
    grad_out = [torch.randn(CONFIG.num_local_input_tokens, CONFIG.hidden_dim).bfloat16() for _ in range(2)]
    with poise.create_context(config=CONFIG, device="cpu", ep_size=2, virtual_ranks=True) as context:
        outs = [poise.routed_experts_virtual(*[lv[n] for n in NAMES], context) for lv in leaves]
        torch.autograd.backward(outs[0], grad_out)  # not the latest forward
        torch.autograd.backward(outs[1], grad_out)  # nor is this one any more
        assert context._backend.recomputed_forwards == 2
    for inputs, lv in zip(layers, leaves):
        _, want = float64_oracle(inputs, grad_out)
        for r in range(2):
            assert relative_error(lv["x_TD"][r].grad, want["x_TD"][r]) < 1e-2


def test_no_grad_and_make_fx_and_opcheck():
    inputs = reference.random_inputs(CONFIG, 2, seed=15)
    with poise.create_context(config=CONFIG, device="cpu", ep_size=2, virtual_ranks=True) as context:
        with torch.no_grad():
            outs = poise.routed_experts_virtual(*[inputs[n] for n in NAMES], context)

        def layer(*tensors):  # two ranks: every argument list has two tensors
            return poise.routed_experts_virtual(*[list(tensors[2 * i:2 * i + 2]) for i in range(5)], context)

        flat = [t for n in NAMES for t in inputs[n]]
        graph = make_fx(layer, tracing_mode="fake")(*flat)
        assert "routed_experts_virtual_forward" in graph.code
        traced = graph(*flat)
        assert all(torch.equal(a, b) for a, b in zip(traced, outs))
        args = ([t.clone().requires_grad_() for t in inputs["x_TD"]], inputs["ids_TK"],
                [t.clone().requires_grad_() for t in inputs["scores_TK"]],
                [t.clone().requires_grad_() for t in inputs["w13"]], [t.clone().requires_grad_() for t in inputs["w2"]],
                context.handle, "gate_up_blocked", False)
        torch.library.opcheck(torch.ops.poise.routed_experts_virtual_forward, args)


def test_validation_names_the_argument():
    inputs = reference.random_inputs(CONFIG, 2, seed=16)
    with poise.create_context(config=CONFIG, device="cpu", ep_size=2, virtual_ranks=True) as context:
        args = [inputs[n] for n in NAMES]
        with pytest.raises(poise.InvalidArgument) as error:
            poise.routed_experts_virtual(args[0][:1], *args[1:], context)
        assert error.value.name == "x_TD" and "one tensor per rank (2)" in error.value.rule
        bad_ids = [inputs["ids_TK"][0], inputs["ids_TK"][1].long()]
        with pytest.raises(poise.InvalidArgument) as error:
            poise.routed_experts_virtual(args[0], bad_ids, *args[2:], context)
        assert error.value.name == "ids_TK" and error.value.rule.startswith("rank 1: ")
        mixed_scores = [inputs["scores_TK"][0], inputs["scores_TK"][1].bfloat16()]
        with pytest.raises(poise.InvalidArgument, match="same dtype"):
            poise.routed_experts_virtual(*args[:2], mixed_scores, *args[3:], context)
        with pytest.raises(poise.InvalidArgument) as error:  # the one-rank call on a virtual context
            poise.routed_experts(*[a[0] for a in args], context)
        assert error.value.name == "context"
        with pytest.raises(poise.NotAvailable, match="accumulate_wgrad"):
            poise.routed_experts_virtual(*args, context, poise.ExecutionOptions(accumulate_wgrad=True))
    with pytest.raises(poise.InvalidArgument) as error:  # closed
        poise.routed_experts_virtual(*args, context)
    assert error.value.name == "context"
    with poise.create_context(config=CONFIG, device="cpu") as one_rank:
        with pytest.raises(poise.InvalidArgument, match="virtual_ranks=True") as error:
            poise.routed_experts_virtual(*[[a[0]] for a in args], one_rank)


def test_create_context_arguments():
    with poise.create_context(config=CONFIG, device="cpu", ep_size=4, virtual_ranks=True) as context:
        assert context.virtual_ranks and context.rank is None and context.ep_size == 4
        assert "all 4 ranks (virtual)" in repr(context)
    with poise.create_context(config=CONFIG, device="cpu") as context:
        assert not context.virtual_ranks and context.rank == 0
    for kwargs, name in (({"rank": 0}, "rank"), ({"group": object()}, "group")):
        with pytest.raises(poise.InvalidArgument) as error:
            poise.create_context(config=CONFIG, device="cpu", ep_size=2, virtual_ranks=True, **kwargs)
        assert error.value.name == name
    with pytest.raises(poise.InvalidArgument) as error:
        poise.create_context(config=CONFIG, device="cpu", ep_size=2, virtual_ranks=1)
    assert error.value.name == "virtual_ranks"
    with pytest.raises(poise.InvalidArgument) as error:  # 8 experts over 3 ranks
        poise.create_context(config=CONFIG, device="cpu", ep_size=3, virtual_ranks=True)
    assert error.value.name in ("num_experts", "ep_size")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a CUDA device")
def test_cuda_virtual_ranks_without_a_device_is_a_device_error():
    with pytest.raises(poise.DeviceError, match="no CUDA device"):
        poise.create_context(config=CONFIG, device="cuda", ep_size=2, virtual_ranks=True)
