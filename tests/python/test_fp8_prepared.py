"""poise.routed_experts(..., prepared=poise.prepare_weights(w13, w2)): prepared FP8 weights, which a
gemm_precision='fp8_block_scaled' GPU context's forward reads instead of quantizing w13 and w2 per
call (docs/fp8.md "Weights", docs/pytorch.md).

CPU (run everywhere): the argument checks by name (type, format, each tensor's dtype, shape, device
and contiguity), InvalidArgument on a BF16 context, NotAvailable on a CPU context (the reference
engine quantizes w13 / w2 itself), and the ops' wiring (schemas, autograd of the prepared forwards,
opcheck) with a stand-in engine. GPU (pytest -m gpu): the bits of the call without them, a refill
with out= after a weight change, the backward's bits after a prepared forward."""

import dataclasses

import pytest
import torch

import poise
from poise import reference
from poise.torch import autograd, checks, engines, ops

NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")
# D = 192 and F = 320: 64 mod 128, so every matrix has a last scale block 64 wide.
CONFIG = poise.Config(num_local_input_tokens=32, hidden_dim=192, intermediate_dim=320, top_k=2, num_experts=8,
                      gemm_precision="fp8_block_scaled")
E, D, F = CONFIG.num_experts, CONFIG.hidden_dim, CONFIG.intermediate_dim


def layer_inputs(config=CONFIG, seed=0, device="cpu", routing="uniform"):
    generated = reference.random_inputs(config, 1, seed=seed, routing=routing, padding_rows=3)
    return {n: generated[n][0].to(device) for n in NAMES}


def call(inputs, context, **kwargs):
    return poise.routed_experts(*[inputs[n] for n in NAMES], context, **kwargs)


@pytest.fixture(params=["eager", "ops"])
def path(request, monkeypatch):
    """The plain-eager bypass, or torch.library's ops (the same checks must run on both)."""
    monkeypatch.setattr(autograd, "EAGER_BYPASS", request.param == "eager")
    return request.param


# ---- CPU: the argument checks --------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs():
    return layer_inputs()


@pytest.fixture(scope="module")
def prepared(inputs):
    return poise.prepare_weights(inputs["w13"], inputs["w2"])


@pytest.fixture
def context():
    with poise.create_context(config=CONFIG, device="cpu") as context:
        yield context


def test_a_bf16_context_refuses_prepared_weights_naming_gemm_precision(inputs, prepared, path):
    with poise.create_context(config=dataclasses.replace(CONFIG, gemm_precision="bf16"), device="cpu") as context:
        with pytest.raises(poise.InvalidArgument, match="gemm_precision") as raised:
            call(inputs, context, prepared=prepared)
        assert raised.value.name == "prepared"
        # With expert biases too (no op takes both: refused before any).
        biases = dict(b13=torch.zeros(E, 2 * F).bfloat16(), b2=torch.zeros(E, D).bfloat16())
        with pytest.raises(poise.InvalidArgument, match="gemm_precision"):
            call(inputs, context, prepared=prepared, **biases)
        call(inputs, context)  # the context stays usable


def test_a_cpu_context_refuses_well_formed_prepared_weights_as_not_available(inputs, prepared, context, path):
    for extra in ({}, dict(b13=torch.zeros(E, 2 * F).bfloat16(), b2=torch.zeros(E, D).bfloat16()),
                  dict(options=poise.ExecutionOptions(clip_statistics=True))):
        with pytest.raises(poise.NotAvailable, match=r"^prepared: the CPU reference engine"):
            call(inputs, context, prepared=prepared, **extra)
    with torch.no_grad():
        assert torch.isfinite(call(inputs, context).float()).all()  # without them: the reference's FP8 forward


def test_a_prepared_fp8_weights_context_refuses_a_call_without_them(inputs, path):
    """Config(prepared_fp8_weights=True) plans no scratch to quantize w13 and w2 into: a call without
    prepared= is refused naming it, before anything runs."""
    config = dataclasses.replace(CONFIG, prepared_fp8_weights=True)
    with poise.create_context(config=config, device="cpu") as context:
        with pytest.raises(poise.InvalidArgument, match="prepared_fp8_weights=True") as raised:
            call(inputs, context)
        assert raised.value.name == "prepared"


def test_transposed_weights_with_prepared_weights_are_not_available(inputs, prepared, context, path):
    transposed = dict(inputs, **{n: inputs[n].transpose(1, 2).contiguous() for n in ("w13", "w2")})
    with pytest.raises(poise.NotAvailable, match="^weights_transposed"):
        call(transposed, context, weights_transposed=True, prepared=prepared)


def _field(prepared, **changes):
    return dataclasses.replace(prepared, **changes)


# (what is passed as prepared, given the valid one) -> (the name the error carries, a fragment of its rule)
MISTAKES = {
    "a tuple": (lambda p: (p.w13, p.w13_scales, p.w2, p.w2_scales), "prepared", "poise.PreparedWeights"),
    "a dict": (lambda p: dataclasses.asdict(p), "prepared", "poise.PreparedWeights"),
    "another format": (lambda p: _field(p, format="fp8_e5m2"), "prepared", "fp8_e4m3"),
    "w13 not a tensor": (lambda p: _field(p, w13=None), "prepared.w13", "torch.Tensor"),
    "w13 in bf16": (lambda p: _field(p, w13=p.w13.to(torch.bfloat16)), "prepared.w13", "torch.float8_e4m3fn"),
    "w13 as uint8 bits": (lambda p: _field(p, w13=p.w13.view(torch.uint8)), "prepared.w13", "torch.float8_e4m3fn"),
    "w13 of fewer experts": (lambda p: _field(p, w13=p.w13[:4]), "prepared.w13", "E_local=8"),
    "w13 flat": (lambda p: _field(p, w13=p.w13.view(E * 2 * F, D)), "prepared.w13", "[E_local, 2F, D]"),
    "w13 transposed": (lambda p: _field(p, w13=p.w13.transpose(1, 2).contiguous()), "prepared.w13", "[E_local, 2F, D]"),
    "w13 not contiguous": (lambda p: _field(p, w13=p.w13.transpose(1, 2).contiguous().transpose(1, 2)),
                           "prepared.w13", "contiguous"),
    "w13 on another device": (lambda p: _field(p, w13=torch.empty_like(p.w13, device="meta")), "prepared.w13",
                              "device"),
    "w13_scales in bf16": (lambda p: _field(p, w13_scales=p.w13_scales.bfloat16()), "prepared.w13_scales",
                           "torch.float32"),
    "w13_scales one block short": (lambda p: _field(p, w13_scales=p.w13_scales[:, :, :1].contiguous()),
                                   "prepared.w13_scales", "[8, 5, 2]"),
    "w2 as w13": (lambda p: _field(p, w2=p.w13), "prepared.w2", "[E_local, D, F]"),
    "w2_scales swapped with w13_scales": (lambda p: _field(p, w2_scales=p.w13_scales), "prepared.w2_scales",
                                          "[8, 2, 3]"),
    "w2_scales not a tensor": (lambda p: _field(p, w2_scales=[1.0]), "prepared.w2_scales", "torch.Tensor"),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_mistake_is_named(inputs, prepared, context, path, mistake):
    change, name, fragment = MISTAKES[mistake]
    with pytest.raises(poise.InvalidArgument) as raised:
        call(inputs, context, prepared=change(prepared))
    assert raised.value.name == name
    assert fragment in raised.value.rule, raised.value.rule


def test_w13_prepared_from_its_2_f_d_view_is_taken(inputs, context):
    """prepare_weights keeps w13's shape: [E_local, 2, F, D] weights give [E_local, 2, F, D] values."""
    w13 = inputs["w13"].view(E, 2, F, D)
    prepared = poise.prepare_weights(w13, inputs["w2"])
    assert prepared.w13.shape == (E, 2, F, D)
    with pytest.raises(poise.NotAvailable, match="^prepared"):  # past every argument check
        call(dict(inputs, w13=w13), context, prepared=prepared)


def test_virtual_ranks_take_no_prepared_weights(inputs, prepared):
    with poise.create_context(config=CONFIG, device="cpu", ep_size=2, virtual_ranks=True) as context:
        with pytest.raises(TypeError, match="prepared"):
            poise.routed_experts_virtual(*[[inputs[n]] * 2 for n in NAMES], context, prepared=prepared)


# ---- CPU: the ops' wiring, with a stand-in for the GPU engine ------------------------------------


TRANSPOSED_NAMES = ["w13_fp8_t", "w13_fp8_t_scales", "w2_fp8_t", "w2_fp8_t_scales"]


def test_the_prepared_ops_take_four_tensors_after_w2_and_the_transposed_copies_last():
    for name in ("routed_experts_prepared_forward", "routed_experts_prepared_forward_clip_counts"):
        schema = getattr(torch.ops.poise, name).default._schema
        assert [a.name for a in schema.arguments] == [
            *NAMES, "w13_fp8", "w13_fp8_scales", "w2_fp8", "w2_fp8_scales", "context_handle", "w13_layout",
            "weights_transposed", "accumulate_wgrad", *TRANSPOSED_NAMES]
        # Only the transposed copies are optional (None: the backward quantizes its own).
        assert [a.name for a in schema.arguments if a.has_default_value()] == TRANSPOSED_NAMES, name
    for name in ("routed_experts_backward", "routed_experts_backward_accumulate"):
        schema = getattr(torch.ops.poise, name).default._schema
        assert [a.name for a in schema.arguments][-4:] == TRANSPOSED_NAMES, name
        assert [a.name for a in schema.arguments if a.has_default_value()] == TRANSPOSED_NAMES, name
    # The other ops' schemas keep their arguments (callers pass them positionally).
    assert len(torch.ops.poise.routed_experts_forward.default._schema.arguments) == 9
    assert len(torch.ops.poise.routed_experts_biased_forward.default._schema.arguments) == 11


@pytest.fixture
def stand_in(monkeypatch, context):
    """A CPU context whose engine takes prepared weights as a GPU one does, where the reference gives
    their bits anyway (it quantizes w13 / w2 itself, bit for bit as prepare_weights): every check but
    the CPU refusal, and the prepared tensors each forward got."""
    monkeypatch.setattr(ops, "check_prepared", checks.check_prepared_arguments)
    engine = engines.engine_of(context)
    forward, backward, seen = engine.forward, engine.backward, []

    def forward_taking_prepared(*args, prepared=None, **kwargs):
        seen.append(prepared)
        return forward(*args, **kwargs)

    def backward_taking_prepared_t(*args, prepared_t=None, **kwargs):
        seen.append(("backward", prepared_t))
        return backward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", forward_taking_prepared)
    monkeypatch.setattr(engine, "backward", backward_taking_prepared_t)
    return context, seen


def leaves_of(inputs, accumulate_wgrad=False):
    """Fresh leaves of the inputs; with accumulate_wgrad, w13 and w2 get zero fp32 .main_grad buffers."""
    leaves = {n: t.clone().requires_grad_(n != "ids_TK") for n, t in inputs.items()}
    if accumulate_wgrad:
        for name in ("w13", "w2"):
            leaves[name].main_grad = torch.zeros(leaves[name].shape, dtype=torch.float32)
    return leaves


def grads_of(leaves, accumulate_wgrad):
    """The grads the step left: x_TD's, scores_TK's, and w13's / w2's (.main_grad with accumulate_wgrad)."""
    return ([leaves[n].grad for n in ("x_TD", "scores_TK")] +
            [leaves[n].main_grad if accumulate_wgrad else leaves[n].grad for n in ("w13", "w2")])


@pytest.mark.parametrize("accumulate_wgrad", [False, True])
@pytest.mark.parametrize("clip_statistics", [False, True])
def test_the_prepared_forward_differentiates_its_five_tensors(inputs, prepared, stand_in, path, accumulate_wgrad,
                                                              clip_statistics):
    """Autograd of the prepared forwards: the backward of the five tensors (the same grads as the
    call without prepared weights), none for the prepared tensors, which are not saved."""
    context, seen = stand_in
    options = poise.ExecutionOptions(accumulate_wgrad=accumulate_wgrad, clip_statistics=clip_statistics)
    grad_out = torch.randn(CONFIG.num_local_input_tokens, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    results = []
    for with_prepared in (False, True):
        leaves = leaves_of(inputs, accumulate_wgrad)
        result = call(leaves, context, options=options, prepared=prepared if with_prepared else None)
        out, counts = result if clip_statistics else (result, None)
        out.backward(grad_out)
        results.append((out.detach(), counts, grads_of(leaves, accumulate_wgrad)))
    forwards = [p for p in seen if not (isinstance(p, tuple) and p[0] == "backward")]
    assert [p is not None for p in forwards[-2:]] == [False, True]
    assert all(a is b for a, b in zip(forwards[-1], (prepared.w13, prepared.w13_scales, prepared.w2, prepared.w2_scales)))
    (out, counts, grads), (out_p, counts_p, grads_p) = results
    assert torch.equal(out, out_p)
    if clip_statistics:
        assert torch.equal(counts, counts_p)
    for g, g_p in zip(grads, grads_p):
        assert g is not None and torch.equal(g, g_p)
    assert all(t.grad is None and not t.requires_grad for t in (prepared.w13, prepared.w2, prepared.w13_scales))


@pytest.mark.parametrize("accumulate_wgrad", [False, True])
def test_the_transposed_copies_reach_the_backward(inputs, stand_in, path, accumulate_wgrad):
    """prepare_weights(..., transposed=True): the forward takes the four copies too, keeps them (not
    differentiated) and hands them to its backward's engine call, whose grads are those of the
    call without them."""
    context, seen = stand_in
    prepared_t = poise.prepare_weights(inputs["w13"], inputs["w2"], transposed=True)
    options = poise.ExecutionOptions(accumulate_wgrad=accumulate_wgrad)
    grad_out = torch.randn(CONFIG.num_local_input_tokens, D, generator=torch.Generator().manual_seed(5)).bfloat16()
    grads = []
    for with_t in (False, True):
        leaves = leaves_of(inputs, accumulate_wgrad)
        prepared = prepared_t if with_t else poise.prepare_weights(inputs["w13"], inputs["w2"])
        call(leaves, context, options=options, prepared=prepared).backward(grad_out)
        grads.append(grads_of(leaves, accumulate_wgrad))
    backwards = [p[1] for p in seen if isinstance(p, tuple) and p[0] == "backward"]
    assert backwards[-2] is None
    assert all(a is b for a, b in zip(backwards[-1], (prepared_t.w13_t, prepared_t.w13_t_scales, prepared_t.w2_t,
                                                      prepared_t.w2_t_scales)))
    for g, g_t in zip(*grads):
        assert g is not None and torch.equal(g, g_t)
    assert all(t.grad is None for t in (prepared_t.w13_t, prepared_t.w2_t))


def test_transposed_copies_of_the_wrong_shape_are_named(inputs, stand_in, path):
    context, _ = stand_in
    prepared_t = poise.prepare_weights(inputs["w13"], inputs["w2"], transposed=True)
    bad = dataclasses.replace(prepared_t, w2_t=prepared_t.w2)  # [E, D, F] where [E, F, D] belongs
    with pytest.raises(poise.InvalidArgument) as raised, torch.no_grad():
        call(inputs, context, prepared=bad)
    assert raised.value.name == "prepared.w2_t"


def test_opcheck_the_prepared_forwards(inputs, prepared, stand_in):
    context, _ = stand_in
    leaves = leaves_of(inputs)
    args = (*[leaves[n] for n in NAMES], prepared.w13, prepared.w13_scales, prepared.w2, prepared.w2_scales,
            context.handle, "gate_up_blocked", False, False)
    # Not test_schema: its mutation check compares the inputs arithmetically, which float8 tensors do not
    # support on the CPU ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn).
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.poise.routed_experts_prepared_forward.default, args, test_utils=tests)
    torch.library.opcheck(torch.ops.poise.routed_experts_prepared_forward_clip_counts.default, args, test_utils=tests)


def test_fake_tensor_tracing_runs_the_checks(inputs, prepared, context):
    from torch._subclasses.fake_tensor import FakeTensorMode

    bad = (prepared.w13[:4], prepared.w13_scales, prepared.w2, prepared.w2_scales)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(poise.InvalidArgument) as raised:
            torch.ops.poise.routed_experts_prepared_forward(*[inputs[n] for n in NAMES], *bad, context.handle,
                                                            "gate_up_blocked", False, False)
    assert raised.value.name == "prepared.w13"


# ---- GPU -----------------------------------------------------------------------------------------


def cuda():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped"])
@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
def test_gpu_prepared_weights_give_the_bits_of_the_per_call_quantization(path, activation, routing):
    """prepare_weights' bits are the forward's own quantization: the same out (and clip counts),
    bit for bit, with and without them."""
    config = dataclasses.replace(CONFIG, activation=activation, swiglu_limit=1.5)
    inputs = layer_inputs(config, seed=60, device=cuda(), routing=routing)
    prepared = poise.prepare_weights(inputs["w13"], inputs["w2"])
    counting = poise.ExecutionOptions(clip_statistics=True)
    with poise.create_context(config=config, device=cuda()) as context, torch.no_grad():
        want = call(inputs, context)
        got = call(inputs, context, prepared=prepared)
        want_counts = call(inputs, context, options=counting)
        got_counts = call(inputs, context, options=counting, prepared=prepared)
        context.check()
    assert torch.isfinite(want.float()).all()
    assert torch.equal(got, want)
    assert torch.equal(got_counts[0], want) and torch.equal(want_counts[0], want)
    assert torch.equal(got_counts[1], want_counts[1])


@pytest.mark.gpu
def test_gpu_the_forward_reads_the_prepared_weights_and_out_refills_them(path):
    """After the weights change in place (an optimizer step), stale prepared weights still give the
    old weights' out (the forward reads them, not w13 / w2); refilled with prepare_weights(out=...)
    they give the new weights' out, bit for bit the call without them."""
    inputs = layer_inputs(CONFIG, seed=61, device=cuda())
    prepared = poise.prepare_weights(inputs["w13"], inputs["w2"])
    pointers = [t.data_ptr() for t in (prepared.w13, prepared.w13_scales, prepared.w2, prepared.w2_scales)]
    changed = layer_inputs(CONFIG, seed=62, device=cuda())
    with poise.create_context(config=CONFIG, device=cuda()) as context, torch.no_grad():
        before = call(inputs, context, prepared=prepared)
        inputs["w13"].copy_(changed["w13"])
        inputs["w2"].copy_(changed["w2"])
        stale = call(inputs, context, prepared=prepared)
        assert poise.prepare_weights(inputs["w13"], inputs["w2"], out=prepared) is prepared
        refilled = call(inputs, context, prepared=prepared)
        want = call(inputs, context)
        context.check()
    assert [t.data_ptr() for t in (prepared.w13, prepared.w13_scales, prepared.w2, prepared.w2_scales)] == pointers
    assert torch.equal(stale, before)
    assert torch.equal(refilled, want)
    assert not torch.equal(refilled, before)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_backward_after_a_prepared_forward_gives_the_grads_of_the_per_call_quantization(path, transposed):
    """The backward after a prepared forward (which quantizes w13 / w2 transposed for DGRAD, or with
    transposed=True reads the prepared transposed copies) gives the grads of the call without
    prepared weights, bit for bit, each on a fresh context; the prepared tensors get no grad."""
    inputs = layer_inputs(CONFIG, seed=63, device=cuda(), routing="one_expert")
    prepared = poise.prepare_weights(inputs["w13"], inputs["w2"], transposed=transposed)
    grad_out = torch.randn(CONFIG.num_local_input_tokens, D, generator=torch.Generator().manual_seed(4))
    grad_out = grad_out.bfloat16().to(cuda())
    results = []
    for with_prepared in (False, True):
        leaves = leaves_of(inputs)
        with poise.create_context(config=CONFIG, device=cuda()) as context:
            out = call(leaves, context, prepared=prepared if with_prepared else None)
            out.backward(grad_out)
            context.check()
        results.append([out.detach()] + [leaves[n].grad for n in ("x_TD", "scores_TK", "w13", "w2")])
    for name, want, got in zip(("out", "x_TD", "scores_TK", "w13", "w2"), *results):
        assert got is not None and torch.isfinite(got.float()).all(), name
        assert torch.equal(got, want), name
    assert all(t.grad is None for t in (prepared.w13, prepared.w2, prepared.w13_scales, prepared.w2_scales))


@pytest.mark.gpu
def test_gpu_prepared_weights_are_checked_against_the_context(path):
    inputs = layer_inputs(CONFIG, seed=64, device=cuda())
    on_gpu = poise.prepare_weights(inputs["w13"], inputs["w2"])
    on_cpu = poise.prepare_weights(inputs["w13"].cpu(), inputs["w2"].cpu())
    with poise.create_context(config=CONFIG, device=cuda()) as context, torch.no_grad():
        with pytest.raises(poise.InvalidArgument, match="context's device") as raised:
            call(inputs, context, prepared=on_cpu)
        assert raised.value.name == "prepared.w13"
        # What the FP8 GEMMs do not take is refused by name, prepared weights or not.
        with pytest.raises(poise.NotAvailable, match="w13_layout"):
            call(inputs, context, w13_layout="gate_up_interleaved", prepared=on_gpu)
        biases = dict(b13=torch.zeros(E, 2 * F, device=cuda()).bfloat16(),
                      b2=torch.zeros(E, D, device=cuda()).bfloat16())
        with pytest.raises(poise.NotAvailable, match="^b13"):
            call(inputs, context, prepared=on_gpu, **biases)
        assert torch.equal(call(inputs, context, prepared=on_gpu), call(inputs, context))
        context.check()
