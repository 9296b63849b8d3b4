"""poise.routed_experts and the poise::routed_experts_* torch.library ops on a CPU context.

Forward and backward against a plain PyTorch float64 implementation (autograd), for several
shapes and routings; the op contracts (opcheck, make_fx, FakeTensor, torch.export); activation
checkpointing; no_grad on a training context; contexts shared by several layers."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

import poise
from poise import reference

TOLERANCE = 1e-2


def make_config(**changes) -> poise.Config:
    fields = dict(num_local_input_tokens=32, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=4)
    return poise.Config(**{**fields, **changes})


def relative_error(got, want) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all()
    if want.norm() == 0:
        return 0.0 if (got == 0).all() else float("inf")
    return ((got - want).norm() / want.norm()).item()


def layer_inputs(config, seed=0, requires_grad=True, **options):
    inputs = {name: values[0] for name, values in reference.random_inputs(config, 1, seed=seed, **options).items()}
    for name in ("x_TD", "scores_TK", "w13", "w2"):
        inputs[name].requires_grad_(requires_grad)
    return inputs


def call(inputs, context, options=None, **kwargs):
    return poise.routed_experts(inputs["x_TD"], inputs["ids_TK"], inputs["scores_TK"], inputs["w13"], inputs["w2"],
                                context, options, **kwargs)


def grads_of(inputs):
    return [inputs[name].grad for name in ("x_TD", "scores_TK", "w13", "w2")]


def float64_oracle(config, inputs, grad_out_TD, w13_layout="gate_up_blocked"):
    leaves = {n: inputs[n].detach().double().requires_grad_() for n in ("x_TD", "scores_TK", "w13", "w2")}
    w13_E2FD, w2_EDF = reference.global_experts([leaves["w13"]], [leaves["w2"]], config)
    out = reference.routed_experts_torch(leaves["x_TD"], inputs["ids_TK"], leaves["scores_TK"], w13_E2FD, w2_EDF,
                                         config, w13_layout=w13_layout)
    names = ("x_TD", "scores_TK", "w13", "w2")
    if not out.requires_grad:  # every entry free (id -1): nothing reaches an input
        return out.detach(), [torch.zeros_like(leaves[n]) for n in names]
    out.backward(grad_out_TD.double())
    return out.detach(), [leaves[n].grad for n in names]


@pytest.fixture
def config():
    return make_config()


@pytest.fixture
def context(config):
    with poise.create_context(config=config, device="cpu") as context:
        yield context


CASES = {
    "base": (dict(), dict(), "gate_up_blocked"),
    "D192-F192-K4-E8": (dict(hidden_dim=192, intermediate_dim=192, top_k=4, num_experts=8), dict(), "gate_up_blocked"),
    "bf16-scores": (dict(), dict(scores_dtype=torch.bfloat16), "gate_up_blocked"),
    "K1-all-tokens-to-expert-0": (dict(top_k=1), dict(routing="one_expert"), "gate_up_blocked"),
    "one-expert-K3": (dict(top_k=3, num_experts=8), dict(routing="one_expert"), "gate_up_blocked"),
    "padding-rows": (dict(), dict(padding_rows=7), "gate_up_blocked"),
    "free-entries": (dict(), dict(free_fraction=0.4), "gate_up_blocked"),
    "every-entry-free": (dict(), dict(free_fraction=1.0), "gate_up_blocked"),
    "clamped": (dict(activation="swiglu_clamped", swiglu_limit=0.25), dict(), "gate_up_blocked"),
    "interleaved": (dict(), dict(), "gate_up_interleaved"),
    "w13-E2_F_D": (dict(), dict(w13_shape="E2_F_D"), "gate_up_blocked"),
    "w13-flat": (dict(), dict(w13_shape="flat"), "gate_up_interleaved"),
    "wgrad-bf16": (dict(wgrad_dtype="bf16"), dict(), "gate_up_blocked"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_backward_match_plain_pytorch_float64(case):
    changes, options, layout = CASES[case]
    config = make_config(**changes)
    inputs = layer_inputs(config, seed=len(case), **options)
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim).bfloat16()
    with poise.create_context(config=config, device="cpu") as context:
        out = call(inputs, context, w13_layout=layout)
        out.backward(grad_out)
    want_out, want_grads = float64_oracle(config, inputs, grad_out, layout)
    assert out.dtype == torch.bfloat16 and out.shape == inputs["x_TD"].shape
    assert relative_error(out, want_out) < TOLERANCE
    for name, got, want in zip(("x_TD", "scores_TK", "w13", "w2"), grads_of(inputs), want_grads):
        assert got.dtype == inputs[name].dtype and got.shape == inputs[name].shape, name
        assert relative_error(got, want) < TOLERANCE, name


def test_sum_backward_gets_a_broadcast_gradient(config, context):
    """out.sum().backward() hands the op a stride-0 gradient: it must be made contiguous, not rejected."""
    inputs = layer_inputs(config)
    call(inputs, context).float().sum().backward()
    _, want = float64_oracle(config, inputs, torch.ones(config.num_local_input_tokens, config.hidden_dim))
    assert relative_error(inputs["x_TD"].grad, want[0]) < TOLERANCE


def test_only_requested_grads_are_returned(config, context):
    inputs = layer_inputs(config, requires_grad=False)
    inputs["scores_TK"].requires_grad_(True)
    call(inputs, context).float().sum().backward()
    assert inputs["scores_TK"].grad is not None
    assert inputs["x_TD"].grad is None and inputs["w13"].grad is None and inputs["w2"].grad is None


def test_opcheck(config, context):
    inputs = layer_inputs(config, requires_grad=True)
    args = (inputs["x_TD"], inputs["ids_TK"], inputs["scores_TK"], inputs["w13"], inputs["w2"], context.handle,
            "gate_up_blocked", False, False)
    torch.library.opcheck(torch.ops.poise.routed_experts_forward.default, args)
    detached = [t.detach() for t in args[:5]]
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim).bfloat16()
    torch.library.opcheck(torch.ops.poise.routed_experts_backward.default,
                          (grad_out, *detached, context.handle, "gate_up_blocked", False))
    buffers = (torch.zeros(detached[3].shape), torch.zeros(detached[4].shape))
    torch.library.opcheck(torch.ops.poise.routed_experts_backward_accumulate.default,
                          (grad_out, *detached, context.handle, "gate_up_blocked", False, *buffers))


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_make_fx_traces_the_op(config, context, tracing_mode):
    inputs = layer_inputs(config, requires_grad=False)

    def layer(x_TD, ids_TK, scores_TK, w13, w2):
        return poise.routed_experts(x_TD, ids_TK, scores_TK, w13, w2, context) * 2

    args = [inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]
    graph = make_fx(layer, tracing_mode=tracing_mode)(*args)
    assert "poise.routed_experts_forward" in graph.code
    assert torch.equal(graph(*args), layer(*args))


def test_make_fx_traces_forward_and_backward(config, context):
    inputs = layer_inputs(config)
    names = ("x_TD", "scores_TK", "w13", "w2")

    def train_step(x_TD, ids_TK, scores_TK, w13, w2):
        out = poise.routed_experts(x_TD, ids_TK, scores_TK, w13, w2, context)
        return torch.autograd.grad(out.float().square().sum(), [x_TD, scores_TK, w13, w2])

    args = [inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]
    graph = make_fx(train_step, tracing_mode="fake")(*args)
    assert "poise.routed_experts_forward" in graph.code and "poise.routed_experts_backward" in graph.code
    for name, got, want in zip(names, graph(*args), train_step(*args)):
        assert torch.equal(got, want), name


def test_fake_tensor_mode_gives_shapes_without_running(config, context):
    inputs = layer_inputs(config)
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(t) for name, t in inputs.items()}
        out = call(fake, context)
        assert out.shape == inputs["x_TD"].shape and out.dtype == torch.bfloat16
        grads = torch.autograd.grad(out.float().sum(), [fake["x_TD"], fake["scores_TK"], fake["w13"], fake["w2"]])
        assert [g.shape for g in grads] == [inputs[n].shape for n in ("x_TD", "scores_TK", "w13", "w2")]
        # Validation runs in the fake implementation too.
        with pytest.raises(poise.InvalidArgument) as raised:
            call({**fake, "ids_TK": fake["ids_TK"].long()}, context)
        assert raised.value.name == "ids_TK"
    assert context._backend is None  # the engine never ran


def test_torch_export_non_strict(config, context):
    inputs = layer_inputs(config, requires_grad=False)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w13 = torch.nn.Parameter(inputs["w13"].clone())
            self.w2 = torch.nn.Parameter(inputs["w2"].clone())

        def forward(self, x_TD, ids_TK, scores_TK):
            return poise.routed_experts(x_TD, ids_TK, scores_TK, self.w13, self.w2, context)

    module = Experts()
    args = (inputs["x_TD"], inputs["ids_TK"], inputs["scores_TK"])
    exported = torch.export.export(module, args, strict=False)
    assert "poise.routed_experts_forward" in str(exported.graph)
    assert torch.equal(exported.module()(*args), module(*args))


def test_activation_checkpointing_gives_the_same_grads(config):
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim).bfloat16()
    results = []
    for checkpointed in (False, True):
        inputs = layer_inputs(config, seed=3)
        with poise.create_context(config=config, device="cpu") as context:
            def layer(x_TD, scores_TK, w13, w2):
                return poise.routed_experts(x_TD, inputs["ids_TK"], scores_TK, w13, w2, context) * 1.5

            args = [inputs[n] for n in ("x_TD", "scores_TK", "w13", "w2")]
            out = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False) if checkpointed else layer(*args)
            out.backward(grad_out)
            if checkpointed:
                assert context._backend.forward_calls == 2  # the recompute ran the op again
        results.append([out.detach(), *grads_of(inputs)])
    for plain, checkpointed in zip(*results):
        assert torch.equal(plain, checkpointed)


def test_no_grad_forward_on_a_training_context(config, context):
    inputs = layer_inputs(config)
    with torch.no_grad():
        evaluated = call(inputs, context)
    assert not evaluated.requires_grad
    trained = call(inputs, context)
    assert torch.equal(evaluated, trained.detach())
    # A no_grad forward between a training forward and its backward does not corrupt the backward.
    other = layer_inputs(config, seed=9)
    with torch.no_grad():
        call(other, context)
    grad_out = torch.randn_like(trained)
    trained.backward(grad_out)
    _, want = float64_oracle(config, inputs, grad_out)
    for got, want_grad in zip(grads_of(inputs), want):
        assert relative_error(got, want_grad) < TOLERANCE
    assert context._backend.recomputed_forwards == 1


def test_inference_context_evaluates_but_refuses_grad():
    config = make_config(inference=True)
    inputs = layer_inputs(config)
    with poise.create_context(config=config, device="cpu") as context:
        with torch.no_grad():
            out = call(inputs, context)
        with poise.create_context(config=make_config(), device="cpu") as training:
            with torch.no_grad():
                assert torch.equal(out, call(inputs, training))
        with pytest.raises(poise.InvalidArgument) as raised:
            call(inputs, context)
        assert raised.value.name == "context"


def test_inference_mode_calls_give_the_no_grad_result(config, context):
    """Under torch.inference_mode() (how serving stacks run models), inputs made there carry no
    version counter; the call runs and gives the no_grad result, and a training backward after it
    still works."""
    inputs = layer_inputs(config, requires_grad=False)
    with torch.no_grad():
        want = call(inputs, context)
    with torch.inference_mode():
        made_here = {name: tensor.clone() for name, tensor in inputs.items()}
        assert made_here["x_TD"].is_inference()
        assert torch.equal(call(made_here, context), want)
    trained = layer_inputs(config)
    call(trained, context).float().square().sum().backward()
    assert all(grad is not None for grad in grads_of(trained))


def test_layers_sharing_a_context(config):
    """Two layers on one context, backward in reverse order: the first layer's backward recomputes."""
    layers = [layer_inputs(config, seed=s) for s in (1, 2)]
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim).bfloat16()
    with poise.create_context(config=config, device="cpu") as context:
        outs = [call(inputs, context) for inputs in layers]
        outs[1].backward(grad_out)
        outs[0].backward(grad_out)
        assert context._backend.recomputed_forwards == 1
    for inputs in layers:
        _, want = float64_oracle(config, inputs, grad_out)
        for got, want_grad in zip(grads_of(inputs), want):
            assert relative_error(got, want_grad) < TOLERANCE


def test_results_are_bitwise_reproducible(config, context):
    """Two runs of the same layer give the same bits, forward and backward (ExecutionOptions)."""
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim).bfloat16()
    runs = []
    for _ in range(2):
        inputs = layer_inputs(config, seed=5)
        out = call(inputs, context)
        out.backward(grad_out)
        runs.append([out.detach(), *grads_of(inputs)])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_torch_compile_fullgraph(config, context):
    """Dynamo traces poise.routed_experts without a graph break (aot_eager: no C++ compiler needed)."""
    inputs = layer_inputs(config)
    names = ("x_TD", "scores_TK", "w13", "w2")

    def loss(x_TD, ids_TK, scores_TK, w13, w2):
        return (poise.routed_experts(x_TD, ids_TK, scores_TK, w13, w2, context) * 2).float().square().sum()

    args = [inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]
    torch.compile(loss, backend="aot_eager", fullgraph=True)(*args).backward()
    compiled = [inputs[n].grad for n in names]
    for n in names:
        inputs[n].grad = None
    loss(*args).backward()
    for name, got in zip(names, compiled):
        assert torch.equal(got, inputs[name].grad), name


# ---- plain eager calls skip torch.library's dispatch (poise.torch.autograd.plain_eager) -------------


def run_layer(config, options, eager_bypass, monkeypatch, seed=3):
    """One forward+backward with the eager bypass on or off: (grad_fn name, outputs, grads, main_grads)."""
    monkeypatch.setattr(poise.torch.autograd, "EAGER_BYPASS", eager_bypass)
    inputs = layer_inputs(config, seed=seed)
    for name in ("w13", "w2"):  # as a model holds them
        inputs[name] = torch.nn.Parameter(inputs[name].detach())
    if options.accumulate_wgrad:
        for name in ("w13", "w2"):
            inputs[name].main_grad = torch.randn(inputs[name].shape, generator=torch.Generator().manual_seed(seed))
    grad_out = torch.randn(config.num_local_input_tokens, config.hidden_dim,
                           generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    with poise.create_context(config=config, device="cpu") as context:
        result = call(inputs, context, options)
        outs = result if isinstance(result, tuple) else (result,)
        outs[0].backward(grad_out)
    main_grads = [inputs[n].main_grad for n in ("w13", "w2")] if options.accumulate_wgrad else []
    return type(outs[0].grad_fn).__name__, outs, grads_of(inputs), main_grads


@pytest.mark.parametrize("options", [poise.ExecutionOptions(), poise.ExecutionOptions(clip_statistics=True),
                                     poise.ExecutionOptions(accumulate_wgrad=True)],
                         ids=["default", "clip_statistics", "accumulate_wgrad"])
def test_plain_eager_skips_the_op_dispatch_with_the_same_bits(options, monkeypatch):
    config = make_config(activation="swiglu_clamped", swiglu_limit=0.25)
    bypass = run_layer(config, options, True, monkeypatch)
    ops = run_layer(config, options, False, monkeypatch)
    assert bypass[0] == "EagerForwardBackward" and ops[0] != bypass[0], (bypass[0], ops[0])
    for got, want in zip([*bypass[1], *bypass[3]], [*ops[1], *ops[3]]):
        assert torch.equal(got, want)
    for got, want in zip(bypass[2], ops[2]):
        assert (got is None and want is None) or torch.equal(got, want)
    if options.clip_statistics:
        assert bypass[1][1].dtype == torch.int64 and bypass[1][1].sum() > 0  # the clamp clipped something


class OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class ScaledTensor(torch.Tensor):
    """A subclass that may override ops: it must take the ops' path."""


def test_tensor_subclasses_take_the_ops(config, context):
    inputs = layer_inputs(config)
    inputs["x_TD"] = inputs["x_TD"].detach().as_subclass(ScaledTensor).requires_grad_()
    assert type(call(inputs, context).grad_fn).__name__ != "EagerForwardBackward"


def test_dispatch_modes_and_the_profiler_see_the_ops(config, context):
    """Anything that intercepts ops gets the torch.library ops, forward and backward."""
    with torch.device("cpu"):  # a torch function mode
        assert type(call(layer_inputs(config), context).grad_fn).__name__ != "EagerForwardBackward"
    inputs = layer_inputs(config)
    with OpNames() as mode:
        out = call(inputs, context)
        out.backward(torch.ones_like(out))
    assert "poise.routed_experts_forward.default" in mode.names
    assert "poise.routed_experts_backward.default" in mode.names
    assert type(out.grad_fn).__name__ != "EagerForwardBackward"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as profile:
        out = call(layer_inputs(config), context)
        out.backward(torch.ones_like(out))
    names = {event.name for event in profile.events()}
    assert {"poise::routed_experts_forward", "poise::routed_experts_backward"} <= names, sorted(names)[:20]


def test_plain_eager_backward_checks_grad_out(config, context):
    """Autograd hands backward a gradient of out's shape and dtype; a direct caller may not."""
    inputs = {name: t.detach() for name, t in layer_inputs(config).items()}
    bad = torch.zeros(config.num_local_input_tokens, config.hidden_dim, dtype=torch.float32)
    tensors = [inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]
    with pytest.raises(poise.InvalidArgument, match="grad_out_TD"):
        poise.torch.autograd.run_backward(bad, tensors, (context.handle, "gate_up_blocked", False), None)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_backward_takes_the_ops(config, context, monkeypatch):
    """Under create_graph the ops' autograd fallback marks the grads as part of a graph (a second
    differentiation then refuses to go through them); the bypass must not hand back plain tensors."""
    requires = []
    for bypass in (False, True):
        monkeypatch.setattr(poise.torch.autograd, "EAGER_BYPASS", bypass)
        inputs = layer_inputs(config)
        out = call(inputs, context)
        out.backward(torch.ones_like(out), create_graph=True)
        requires.append(inputs["x_TD"].grad.requires_grad)
    assert requires == [True, True]
