"""ExecutionOptions(accumulate_wgrad=True): weight grads added in place into .main_grad / .grad.

The contract (docs/pytorch.md): the buffer is ``w.main_grad`` if the parameter has that attribute
(Megatron's gradient_accumulation_fusion), else ``w.grad`` (created as zeros when None, if the
parameter's dtype is Config.wgrad_dtype); autograd receives None for w13 and w2."""

import pytest
import torch

import poise
import poise.torch  # noqa: F401 (registers the ops)
from poise import reference

ACCUMULATE = poise.ExecutionOptions(accumulate_wgrad=True)


def make_config(**changes) -> poise.Config:
    fields = dict(num_local_input_tokens=32, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=4)
    return poise.Config(**{**fields, **changes})


def micro_batches(config, count):
    """Inputs of `count` micro-batches sharing one pair of weights (leaf parameters)."""
    batches = [{k: v[0] for k, v in reference.random_inputs(config, 1, seed=s).items()} for s in range(count)]
    w13 = torch.nn.Parameter(batches[0]["w13"])
    w2 = torch.nn.Parameter(batches[0]["w2"])
    grad_outs = [torch.randn(config.num_local_input_tokens, config.hidden_dim).bfloat16() for _ in range(count)]
    return batches, w13, w2, grad_outs


def wgrads_without_accumulation(config, batches, w13, w2, grad_outs):
    """Per micro-batch (grad_w13, grad_w2) in Config.wgrad_dtype, from the reference engine (the
    backward op returns the weights' bf16 without accumulation)."""
    engine = reference.Engine(config, 1)
    grads = []
    for batch, grad_out in zip(batches, grad_outs):
        engine.forward([batch["x_TD"]], [batch["ids_TK"]], [batch["scores_TK"]], [w13.detach()], [w2.detach()])
        rank = engine.backward([grad_out])[0]
        grads.append((rank.grad_w13, rank.grad_w2))
    return grads


@pytest.mark.parametrize("virtual_ranks", [False, True])
def test_without_accumulation_weight_grads_come_in_the_weights_dtype(virtual_ranks):
    """wgrad_dtype='fp32' is the accumulation dtype: the plain backward op returns bf16 weight grads,
    the fp32 grads rounded once (what autograd would otherwise cast), for one rank and virtual ranks."""
    config = make_config(wgrad_dtype="fp32")
    ep_size = 2 if virtual_ranks else 1
    inputs = reference.random_inputs(config, ep_size, seed=7)
    grad_outs = [torch.randn(config.num_local_input_tokens, config.hidden_dim).bfloat16() for _ in range(ep_size)]
    engine = reference.Engine(config, ep_size)
    engine.forward(*[inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")])
    want = engine.backward(grad_outs)
    assert want[0].grad_w13.dtype == torch.float32
    names = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")
    with poise.create_context(config=config, device="cpu", ep_size=ep_size, virtual_ranks=virtual_ranks) as context:
        if virtual_ranks:
            op, args = torch.ops.poise.routed_experts_virtual_backward, [grad_outs] + [inputs[n] for n in names]
        else:
            op, args = torch.ops.poise.routed_experts_backward, [grad_outs[0]] + [inputs[n][0] for n in names]
        _, _, g13, g2 = op(*args, context.handle, "gate_up_blocked", False)
    g13, g2 = (g13, g2) if virtual_ranks else ([g13], [g2])
    for r in range(ep_size):
        for got, fp32 in ((g13[r], want[r].grad_w13), (g2[r], want[r].grad_w2)):
            assert got.dtype == torch.bfloat16 and torch.equal(got, fp32.to(torch.bfloat16)), r


def test_main_grad_fp32_accumulates_exactly_in_place():
    config = make_config(wgrad_dtype="fp32")
    batches, w13, w2, grad_outs = micro_batches(config, 2)
    w13.main_grad = torch.randn(w13.shape)  # what an earlier micro-batch left there
    w2.main_grad = torch.randn(w2.shape)
    start = (w13.main_grad.clone(), w2.main_grad.clone())
    buffers = (w13.main_grad.data_ptr(), w2.main_grad.data_ptr())
    with poise.create_context(config=config, device="cpu") as context:
        for batch, grad_out in zip(batches, grad_outs):
            out = poise.routed_experts(batch["x_TD"], batch["ids_TK"], batch["scores_TK"], w13, w2, context, ACCUMULATE)
            out.backward(grad_out)
    assert (w13.main_grad.data_ptr(), w2.main_grad.data_ptr()) == buffers  # in place
    assert w13.grad is None and w2.grad is None  # autograd got None
    plain = wgrads_without_accumulation(config, batches, w13, w2, grad_outs)
    # fp32: the op adds each call's fp32 sum into the buffer, so the order of additions is known.
    assert torch.equal(w13.main_grad, start[0] + plain[0][0] + plain[1][0])
    assert torch.equal(w2.main_grad, start[1] + plain[0][1] + plain[1][1])


def test_grad_bf16_is_created_then_accumulated():
    config = make_config(wgrad_dtype="bf16")
    batches, w13, w2, grad_outs = micro_batches(config, 2)
    with poise.create_context(config=config, device="cpu") as context:
        batch = batches[0]
        poise.routed_experts(batch["x_TD"], batch["ids_TK"], batch["scores_TK"], w13, w2, context,
                             ACCUMULATE).backward(grad_outs[0])
        assert w13.grad is not None and w13.grad.dtype == torch.bfloat16
        first, pointer = w13.grad.clone(), w13.grad.data_ptr()
        batch = batches[1]
        poise.routed_experts(batch["x_TD"], batch["ids_TK"], batch["scores_TK"], w13, w2, context,
                             ACCUMULATE).backward(grad_outs[1])
        assert w13.grad.data_ptr() == pointer
    plain = wgrads_without_accumulation(config, batches, w13, w2, grad_outs)
    assert torch.equal(first, plain[0][0])  # the first call adds to zeros
    for got, want in ((w13.grad, plain[0][0].double() + plain[1][0].double()),
                      (w2.grad, plain[0][1].double() + plain[1][1].double())):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


def test_accumulation_through_activation_checkpointing():
    config = make_config()
    batches, w13, w2, grad_outs = micro_batches(config, 1)
    w13.main_grad, w2.main_grad = torch.zeros(w13.shape), torch.zeros(w2.shape)
    batch = batches[0]
    with poise.create_context(config=config, device="cpu") as context:
        out = torch.utils.checkpoint.checkpoint(
            lambda x: poise.routed_experts(x, batch["ids_TK"], batch["scores_TK"], w13, w2, context, ACCUMULATE),
            batch["x_TD"].requires_grad_(), use_reentrant=False)
        out.backward(grad_outs[0])
    plain = wgrads_without_accumulation(config, batches, w13, w2, grad_outs)
    assert torch.equal(w13.main_grad, plain[0][0]) and torch.equal(w2.main_grad, plain[0][1])


def run_once(config, w13, w2):
    batch = {k: v[0] for k, v in reference.random_inputs(config, 1).items()}
    with poise.create_context(config=config, device="cpu") as context:
        poise.routed_experts(batch["x_TD"], batch["ids_TK"], batch["scores_TK"], w13, w2, context,
                             ACCUMULATE).float().sum().backward()


def test_bf16_weights_without_main_grad_need_one_for_fp32_wgrad():
    config = make_config(wgrad_dtype="fp32")
    _, w13, w2, _ = micro_batches(config, 1)
    with pytest.raises(poise.InvalidArgument) as raised:
        run_once(config, w13, w2)
    assert raised.value.name == "w13" and "main_grad" in raised.value.rule


@pytest.mark.parametrize("bad, name", [
    (lambda w: torch.zeros(w.shape, dtype=torch.bfloat16), "w13.main_grad"),   # not wgrad_dtype
    (lambda w: torch.zeros(w.shape[0], 1), "w13.main_grad"),                   # wrong shape
    (lambda w: torch.zeros(w.shape[::-1]).transpose(0, -1), "w13.main_grad"),  # not contiguous
])
def test_a_bad_main_grad_is_named(bad, name):
    config = make_config(wgrad_dtype="fp32")
    _, w13, w2, _ = micro_batches(config, 1)
    w13.main_grad, w2.main_grad = bad(w13), torch.zeros(w2.shape)
    with pytest.raises(poise.InvalidArgument) as raised:
        run_once(config, w13, w2)
    assert raised.value.name == name


def test_accumulation_needs_the_parameters_themselves():
    config = make_config(wgrad_dtype="bf16")
    _, w13, w2, _ = micro_batches(config, 1)
    with pytest.raises(poise.InvalidArgument) as raised:
        run_once(config, w13.view(-1, config.hidden_dim), w2)
    assert raised.value.name == "w13" and "leaf" in raised.value.rule
