"""Every mistake a host can see raises poise.InvalidArgument naming the argument, before anything runs."""

import pytest
import torch

import poise
from poise import reference

CONFIG = poise.Config(num_local_input_tokens=32, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=4)
T, D, F, K, E = 32, 128, 64, 2, 4


@pytest.fixture(scope="module")
def inputs():
    return {k: v[0] for k, v in reference.random_inputs(CONFIG, 1, seed=1).items()}


@pytest.fixture
def context():
    with poise.create_context(config=CONFIG, device="cpu") as context:
        yield context


def with_duplicate_pick(ids):
    ids = ids.clone()
    ids[5, 1] = ids[5, 0]
    return ids


def with_id(ids, value):
    ids = ids.clone()
    ids[3, 1] = value
    return ids


# (argument changes, the name the error must carry, a fragment of its rule)
MISTAKES = {
    "x fp32": (lambda i: dict(x_TD=i["x_TD"].float()), "x_TD", "torch.bfloat16"),
    "x T differs from the Config": (lambda i: dict(x_TD=i["x_TD"][:16]), "x_TD", "num_local_input_tokens"),
    "x wrong D": (lambda i: dict(x_TD=i["x_TD"][:, :64].contiguous()), "x_TD", "D=128"),
    "x 3-D": (lambda i: dict(x_TD=i["x_TD"].reshape(4, 8, D)), "x_TD", "shape"),
    "x not contiguous": (lambda i: dict(x_TD=i["x_TD"].t().contiguous().t()), "x_TD", "contiguous"),
    "x not a tensor": (lambda i: dict(x_TD=i["x_TD"].tolist()), "x_TD", "torch.Tensor"),
    "ids int64": (lambda i: dict(ids_TK=i["ids_TK"].long()), "ids_TK", "ids_TK.to(torch.int32)"),
    "ids wrong K": (lambda i: dict(ids_TK=i["ids_TK"][:, :1].contiguous()), "ids_TK", "K=2"),
    "ids out of range": (lambda i: dict(ids_TK=with_id(i["ids_TK"], E)), "ids_TK", "out of range"),
    "ids negative": (lambda i: dict(ids_TK=with_id(i["ids_TK"], -2)), "ids_TK", "out of range"),
    "ids picked twice": (lambda i: dict(ids_TK=with_duplicate_pick(i["ids_TK"])), "ids_TK", "twice"),
    "scores fp16": (lambda i: dict(scores_TK=i["scores_TK"].half()), "scores_TK", "torch.float32"),
    "scores fp64": (lambda i: dict(scores_TK=i["scores_TK"].double()), "scores_TK", "torch.float32"),
    "scores T differs": (lambda i: dict(scores_TK=i["scores_TK"][:8]), "scores_TK", "num_local_input_tokens"),
    "w13 fp32": (lambda i: dict(w13=i["w13"].float()), "w13", "torch.bfloat16"),
    "w13 wrong shape": (lambda i: dict(w13=i["w13"].reshape(E, F, 2 * D)), "w13", "[E_local, 2, F, D]"),
    "w13 too few experts": (lambda i: dict(w13=i["w13"][:2]), "w13", "E_local=4"),
    "w13 not contiguous": (lambda i: dict(w13=i["w13"].transpose(1, 2).contiguous().transpose(1, 2)), "w13",
                           "contiguous"),
    "w2 wrong shape": (lambda i: dict(w2=i["w2"].reshape(E, F, D)), "w2", "[E_local, D, F]"),
    "w2 fp32": (lambda i: dict(w2=i["w2"].float()), "w2", "torch.bfloat16"),
    "bad w13_layout": (lambda i: dict(w13_layout="up_gate"), "w13_layout", "gate_up_blocked"),
    "options not ExecutionOptions": (lambda i: dict(options=dict(accumulate_wgrad=True)), "options", "ExecutionOptions"),
    "options field not a bool": (lambda i: dict(options=poise.ExecutionOptions(accumulate_wgrad=1)),
                                 "accumulate_wgrad", "bool"),
    "context not a Context": (lambda i: dict(target=object()), "context", "poise.Context"),
}


def call(inputs, context, x_TD=None, ids_TK=None, scores_TK=None, w13=None, w2=None, **kwargs):
    pick = lambda value, name: inputs[name] if value is None else value
    context = kwargs.pop("target", context)  # a replacement for the context argument
    options = kwargs.pop("options", None)
    return poise.routed_experts(pick(x_TD, "x_TD"), pick(ids_TK, "ids_TK"), pick(scores_TK, "scores_TK"),
                                pick(w13, "w13"), pick(w2, "w2"), context, options, **kwargs)


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_mistake_is_named(inputs, context, mistake):
    changes, name, fragment = MISTAKES[mistake]
    with pytest.raises(poise.InvalidArgument) as raised:
        call(inputs, context, **changes(inputs))
    assert raised.value.name == name
    assert fragment in raised.value.rule, raised.value.rule
    assert str(raised.value).startswith(f"{name}: ")
    if context._backend is not None:
        assert context._backend.forward_calls == 0  # rejected before the engine ran


def test_the_valid_call_passes(inputs, context):
    """The control: without a mistake the same call runs (so the cases above fail for their reason)."""
    assert call(inputs, context).shape == (T, D)


def test_closed_context(inputs):
    context = poise.create_context(config=CONFIG, device="cpu")
    context.close()
    with pytest.raises(poise.InvalidArgument) as raised:
        call(inputs, context)
    assert raised.value.name == "context" and "closed" in raised.value.rule


def test_a_cuda_context_rejects_cpu_tensors(inputs):
    with poise.create_context(config=CONFIG, device="cuda") as context:
        with pytest.raises(poise.InvalidArgument) as raised:
            call(inputs, context)
    assert raised.value.name == "x_TD" and "device" in raised.value.rule


def test_a_context_handle_that_is_gone(inputs):
    with pytest.raises(poise.InvalidArgument) as raised:
        torch.ops.poise.routed_experts_forward(inputs["x_TD"], inputs["ids_TK"], inputs["scores_TK"], inputs["w13"],
                                               inputs["w2"], 10**9, "gate_up_blocked", False, False)
    assert raised.value.name == "context"




def test_backward_op_checks_grad_out(inputs, context):
    args = [inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]
    with pytest.raises(poise.InvalidArgument) as raised:
        torch.ops.poise.routed_experts_backward(torch.zeros(T, D), *args, context.handle, "gate_up_blocked", False)
    assert raised.value.name == "grad_out_TD"
    with pytest.raises(poise.InvalidArgument) as raised:
        torch.ops.poise.routed_experts_backward_accumulate(
            torch.zeros(T, D, dtype=torch.bfloat16), *args, context.handle, "gate_up_blocked", False,
            torch.zeros(inputs["w13"].shape, dtype=torch.bfloat16), torch.zeros(inputs["w2"].shape))
    assert raised.value.name == "grad_w13_acc"  # fp32 wgrad_dtype: the buffer must be fp32
