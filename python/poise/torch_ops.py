"""PyTorch integration: the torch.library ops poise::routed_experts_*, their fake (meta)
implementations and autograd, and poise.routed_experts.

Ops (namespace "poise"; importing this module registers them):

  routed_experts_forward(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout,
                         accumulate_wgrad) -> out_TD
  routed_experts_backward(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle,
                          w13_layout) -> (grad_x_TD, grad_scores_TK, grad_w13, grad_w2)
  routed_experts_backward_accumulate(..., grad_w13_acc!, grad_w2_acc!) -> (grad_x_TD, grad_scores_TK)
  routed_experts_forward_clip_counts(same as forward) -> (out_TD, clip_counts_E2)
      the forward that also counts the clamped SwiGLU's clipped inputs (int64 [E_local, 2]:
      gate > limit, |up| > limit, over every row of each local expert; zeros for plain SwiGLU)

The context travels as its integer handle; the context itself keeps what backward needs (the GPU
in an activation slot, the CPU reference in its engine), so forward returns out_TD only. A CUDA
context gets raw pointers and the current stream (no DLPack conversion, no hidden stream sync);
a CPU context runs the reference engine. See docs/pytorch.md.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import _poise
from .context import Context, context_from_handle
from .errors import InvalidArgument, NotAvailable
from .options import ExecutionOptions
from .reference import ContextEngine, VirtualRanksEngine, call_identity, check_accumulation_buffer
from .torch_checks import (SCORES_DTYPES, WEIGHT_GRAD_DTYPE_NAME, check_grad_out, check_inputs, check_w13_layout,
                           wgrad_dtype)


# ---- engines behind a context --------------------------------------------------------------------


class CudaEngine:
    """A CUDA context's calls: device pointers and the current stream into the C++ entry points.

    ``forward_ranks`` / ``backward_ranks`` take one (x_TD, ids_TK, scores_TK, w13, w2) tuple per
    launch rank: one for a one-rank context, ep_size for a virtual-ranks context.

    Each forward returns the C++ activation record (index, generation) that holds what its backward
    needs (a layer of the selected activation slot, or the working buffers); the engine remembers it
    by the inputs' identity and hands it to the backward, which runs from it, or first rebuilds the
    forward's routing, dispatch and W13 GEMM when a later forward overwrote it (decided on the host
    from generations, so a captured CUDA graph replays the same sequence).
    """

    # Records remembered (oldest dropped first): a dropped one costs its backward a recompute.
    _MAX_RECORDS = 256

    def __init__(self, context: Context):
        self._cpp = context._cpp  # not the Context: it owns this engine
        self._virtual_ranks = context.virtual_ranks
        self._ep_size = context.ep_size
        self._records: dict[tuple, tuple[int, int]] = {}
        self.forward_calls = 0
        self.backward_calls = 0

    @property
    def recomputed_forwards(self) -> int:
        """Backwards that rebuilt their forward (counted by the C++ context)."""
        return self._cpp.recomputed_forwards

    def reset(self) -> None:
        self._records.clear()

    # One rank (poise.routed_experts).
    def forward(self, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str, clip_counts: bool = False):
        """out_TD, or (out_TD, clip_counts_E2) with ``clip_counts``."""
        outs = self.forward_ranks([(x_TD, ids_TK, scores_TK, w13, w2)], w13_layout, clip_counts)
        return (outs[0][0], outs[1][0]) if clip_counts else outs[0]

    def backward(self, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str, accumulate):
        grads = self.backward_ranks([grad_out_TD], [(x_TD, ids_TK, scores_TK, w13, w2)], w13_layout,
                                    None if accumulate is None else [accumulate])
        return tuple(per_rank[0] for per_rank in grads)

    # Every launch rank.
    def forward_ranks(self, ranks: list[tuple], w13_layout: str, clip_counts: bool = False):
        """Per rank out_TD, or (out_TD list, clip_counts_E2 list) with ``clip_counts``."""
        out_TD = [torch.empty_like(inputs[0]) for inputs in ranks]
        counts = ([torch.empty(self._cpp.config.num_local_experts(self._ep_size), 2, dtype=torch.int64,
                               device=inputs[0].device) for inputs in ranks] if clip_counts else None)
        # Nothing requires grad: no backward follows, take no slot position. (Grad mode cannot tell:
        # the op runs inside an autograd.Function forward, where it is always off.)
        keep = any(t.requires_grad for inputs in ranks for t in inputs)
        key = _identity(ranks)
        self._records.pop(key, None)
        record = self._launch_forward(ranks, w13_layout, out_TD, counts, keep)
        if keep:
            self._records[key] = record
            while len(self._records) > self._MAX_RECORDS:
                self._records.pop(next(iter(self._records)))
        self.forward_calls += 1
        return (out_TD, counts) if clip_counts else out_TD

    def backward_ranks(self, grad_out_TD: list[Tensor], ranks: list[tuple], w13_layout: str,
                       accumulate: Optional[list[tuple[Tensor, Tensor]]]):
        """Returns per-rank lists (grad_x_TD, grad_scores_TK, grad_w13, grad_w2); the weight grads in
        the weights' dtype, or with ``accumulate`` (a (grad_w13, grad_w2) pair of Config.wgrad_dtype
        buffers per rank) added into those buffers, which are returned."""
        # Not remembered (a no_grad forward, or dropped): (-1, 0) makes the C++ side rebuild it.
        record = self._records.pop(_identity(ranks), (-1, 0))
        grad_x_TD = [torch.empty_like(inputs[0]) for inputs in ranks]
        grad_scores_TK = [torch.empty_like(inputs[2]) for inputs in ranks]
        if accumulate is None:
            # Autograd would cast fp32 grads to the weights' bf16: the kernels write bf16 instead
            # (the same bits, half the bytes, no cast pass).
            call_wgrad_dtype = WEIGHT_GRAD_DTYPE_NAME
            grad_w13 = [torch.empty_like(inputs[3]) for inputs in ranks]
            grad_w2 = [torch.empty_like(inputs[4]) for inputs in ranks]
        else:
            call_wgrad_dtype = None  # Config.wgrad_dtype, the buffers' (checked)
            grad_w13, grad_w2 = [pair[0] for pair in accumulate], [pair[1] for pair in accumulate]
        device = ranks[0][0].device
        stream = torch.cuda.current_stream(device).cuda_stream
        scores_dtype = SCORES_DTYPES[ranks[0][2].dtype]
        with torch.cuda.device(device):
            if self._virtual_ranks:
                _poise.routed_experts_backward_ranks(
                    self._cpp, _addresses(r[0] for r in ranks), _addresses(r[1] for r in ranks),
                    _addresses(r[2] for r in ranks), scores_dtype, _addresses(r[3] for r in ranks), w13_layout,
                    _addresses(r[4] for r in ranks), _addresses(grad_out_TD), _addresses(grad_x_TD),
                    _addresses(grad_scores_TK), _addresses(grad_w13), _addresses(grad_w2), accumulate is not None,
                    stream, record, call_wgrad_dtype)
            else:  # the scalar entry point: no lists on the one-rank hot path
                (x, ids, scores, w13, w2), = ranks
                _poise.routed_experts_backward(
                    self._cpp, x.data_ptr(), ids.data_ptr(), scores.data_ptr(), scores_dtype, w13.data_ptr(),
                    w13_layout, w2.data_ptr(), grad_out_TD[0].data_ptr(), grad_x_TD[0].data_ptr(),
                    grad_scores_TK[0].data_ptr(), grad_w13[0].data_ptr(), grad_w2[0].data_ptr(),
                    accumulate is not None, stream, record, call_wgrad_dtype)
        self.backward_calls += 1
        return grad_x_TD, grad_scores_TK, grad_w13, grad_w2

    def _launch_forward(self, ranks: list[tuple], w13_layout: str, out_TD: list[Tensor],
                        clip_counts: Optional[list[Tensor]], keep_for_backward: bool) -> tuple[int, int]:
        device = ranks[0][0].device
        stream = torch.cuda.current_stream(device).cuda_stream
        scores_dtype = SCORES_DTYPES[ranks[0][2].dtype]
        with torch.cuda.device(device):  # the pipeline allocates on the current device
            if self._virtual_ranks:
                return _poise.routed_experts_forward_ranks(
                    self._cpp, _addresses(r[0] for r in ranks), _addresses(r[1] for r in ranks),
                    _addresses(r[2] for r in ranks), scores_dtype, _addresses(r[3] for r in ranks), w13_layout,
                    _addresses(r[4] for r in ranks), _addresses(out_TD), stream,
                    _addresses(clip_counts) if clip_counts else [], keep_for_backward)
            (x, ids, scores, w13, w2), = ranks
            return _poise.routed_experts_forward(
                self._cpp, x.data_ptr(), ids.data_ptr(), scores.data_ptr(), scores_dtype, w13.data_ptr(),
                w13_layout, w2.data_ptr(), out_TD[0].data_ptr(), stream,
                clip_counts[0].data_ptr() if clip_counts else 0, keep_for_backward)


def _addresses(tensors) -> list[int]:
    return [t.data_ptr() for t in tensors]


def _identity(ranks: list[tuple]) -> tuple:
    return call_identity([t for inputs in ranks for t in inputs])


def _open_context(handle: int) -> Context:
    context = context_from_handle(handle)
    context._require_open()
    return context


def _engine(context: Context) -> Any:
    if context._backend is None:
        if context.device != "cpu":
            context._backend = CudaEngine(context)
        elif context.virtual_ranks:
            context._backend = VirtualRanksEngine(context)
        else:
            context._backend = ContextEngine(context)
    return context._backend


def _check_call(context: Context, x_TD, ids_TK, scores_TK, w13, w2, w13_layout) -> None:
    if context.virtual_ranks:
        raise InvalidArgument("context", "is a virtual-ranks context (all ranks in this process): call "
                                         "poise.routed_experts_virtual with one tensor per rank")
    check_w13_layout(w13_layout)
    check_inputs(context._cpp.config, context.ep_size, context.device, x_TD, ids_TK, scores_TK, w13, w2)


# ---- the ops -------------------------------------------------------------------------------------


@torch.library.custom_op("poise::routed_experts_forward", mutates_args=())
def routed_experts_forward(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, accumulate_wgrad: bool,
) -> Tensor:
    return _forward_impl(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, clip_counts=False)


@routed_experts_forward.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, accumulate_wgrad):
    _check_call(_open_context(context_handle), x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    return torch.empty_like(x_TD)


@torch.library.custom_op("poise::routed_experts_forward_clip_counts", mutates_args=())
def routed_experts_forward_clip_counts(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, accumulate_wgrad: bool,
) -> tuple[Tensor, Tensor]:
    return _forward_impl(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, clip_counts=True)


def _forward_impl(x_TD, ids_TK, scores_TK, w13, w2, context_handle: int, w13_layout: str, clip_counts: bool):
    """The forward ops' implementation (and the plain-eager bypass's): out_TD, or with clip_counts
    (out_TD, clip_counts_E2)."""
    context = _open_context(context_handle)
    _check_call(context, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    return _engine(context).forward(x_TD, ids_TK, scores_TK, w13, w2, w13_layout, clip_counts=clip_counts)


@routed_experts_forward_clip_counts.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, accumulate_wgrad):
    context = _open_context(context_handle)
    _check_call(context, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    return torch.empty_like(x_TD), x_TD.new_empty(clip_counts_shape(context), dtype=torch.int64)


def clip_counts_shape(context: Context) -> tuple[int, int]:
    return (context._cpp.config.num_local_experts(context.ep_size), 2)


@torch.library.custom_op("poise::routed_experts_backward", mutates_args=())
def routed_experts_backward(
    grad_out_TD: Tensor, x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward_impl((grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout), None)


@routed_experts_backward.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout):
    _open_backward(context_handle, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    return torch.empty_like(x_TD), torch.empty_like(scores_TK), torch.empty_like(w13), torch.empty_like(w2)


@torch.library.custom_op("poise::routed_experts_backward_accumulate", mutates_args=("grad_w13_acc", "grad_w2_acc"))
def routed_experts_backward_accumulate(
    grad_out_TD: Tensor, x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, grad_w13_acc: Tensor, grad_w2_acc: Tensor,
) -> tuple[Tensor, Tensor]:
    return _backward_impl((grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout),
                          (grad_w13_acc, grad_w2_acc))


def _backward_impl(args: tuple, accumulate: Optional[tuple[Tensor, Tensor]], inputs_checked: bool = False) -> tuple:
    """The backward ops' implementation (and the plain-eager bypass's, whose forward checked the
    inputs): (grad_x_TD, grad_scores_TK, grad_w13, grad_w2), or with ``accumulate`` (the two buffers
    the weight grads are added into) (grad_x_TD, grad_scores_TK)."""
    grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout = args
    context = _open_backward(context_handle, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout,
                             inputs_checked)
    if accumulate is None:
        return _engine(context).backward(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout, None)
    _check_accumulation(context, w13, w2, *accumulate)
    grad_x_TD, grad_scores_TK, _, _ = _engine(context).backward(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2,
                                                                w13_layout, accumulate)
    return grad_x_TD, grad_scores_TK


@routed_experts_backward_accumulate.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, grad_w13_acc, grad_w2_acc):
    context = _open_backward(context_handle, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    _check_accumulation(context, w13, w2, grad_w13_acc, grad_w2_acc)
    return torch.empty_like(x_TD), torch.empty_like(scores_TK)


def _open_backward(context_handle, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout,
                   inputs_checked: bool = False) -> Context:
    context = _open_context(context_handle)
    if context._cpp.config.inference:
        raise InvalidArgument("context", "was created with inference=true; backward needs a training context")
    if not inputs_checked:
        _check_call(context, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    check_grad_out(context._cpp.config, context.device, grad_out_TD)
    return context


def _check_accumulation(context: Context, w13, w2, grad_w13_acc, grad_w2_acc) -> None:
    check_accumulation_buffer("grad_w13_acc", grad_w13_acc, w13, context._cpp.config)
    check_accumulation_buffer("grad_w2_acc", grad_w2_acc, w2, context._cpp.config)


# ---- autograd ------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    x_TD, ids_TK, scores_TK, w13, w2, handle, w13_layout, accumulate_wgrad = inputs
    ctx.save_for_backward(x_TD, ids_TK, scores_TK, w13, w2)
    # The handle, not the Context: an autograd graph kept alive (say, until interpreter exit) must
    # not keep the context's buffers alive with it. Backward finds the context by its handle.
    ctx.context_handle = handle
    ctx.w13_layout = w13_layout
    # With accumulation the parameters themselves are needed: their .main_grad / .grad.
    ctx.weights = (w13, w2) if accumulate_wgrad else None


def _backward(ctx, grad_out_TD):
    x_TD, ids_TK, scores_TK, w13, w2 = ctx.saved_tensors
    needs = ctx.needs_input_grad
    # Autograd may hand a broadcast (stride 0) or otherwise strided gradient: the ops need rows.
    grad_out_TD = grad_out_TD.contiguous()
    args = (grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, ctx.context_handle, ctx.w13_layout)
    if ctx.weights is None:
        grad_x, grad_scores, grad_w13, grad_w2 = _run_backward(args, None)
    else:
        config = context_from_handle(ctx.context_handle)._cpp.config
        buffers = tuple(accumulation_buffer(weight, name, config) if need else torch.zeros_like(weight, dtype=wgrad_dtype(config))
                        for weight, name, need in zip(ctx.weights, ("w13", "w2"), needs[3:5]))
        grad_x, grad_scores = _run_backward(args, buffers)
        grad_w13 = grad_w2 = None  # already added into the buffers: autograd must not add them again
    return (grad_x if needs[0] else None, None, grad_scores if needs[2] else None,
            grad_w13 if needs[3] else None, grad_w2 if needs[4] else None, None, None, None)


def _run_backward(args: tuple, accumulate: Optional[tuple[Tensor, Tensor]]) -> tuple:
    """The backward op of ``args`` (and the accumulation buffers), or in plain eager mode its engine
    call directly. The inputs were checked by the forward whose graph this is (autograd refuses saved
    tensors modified in place since), so only grad_out and the buffers are checked here."""
    tensors = args[:6] if accumulate is None else (*args[:6], *accumulate)
    # Grad mode on in a backward means create_graph=True: the ops' autograd fallback marks what a
    # second differentiation cannot go through; a direct call would hand back plain tensors.
    if torch.is_grad_enabled() or not _plain_eager(tensors):
        if accumulate is None:
            return torch.ops.poise.routed_experts_backward(*args)
        return torch.ops.poise.routed_experts_backward_accumulate(*args, *accumulate)
    return _backward_impl(args, accumulate, inputs_checked=True)


torch.library.register_autograd("poise::routed_experts_forward", _backward, setup_context=_setup_context)
# The counts are integers: no gradient flows back through them.
torch.library.register_autograd("poise::routed_experts_forward_clip_counts",
                                lambda ctx, grad_out_TD, _grad_counts: _backward(ctx, grad_out_TD),
                                setup_context=_setup_context)


def accumulation_buffer(weight: Tensor, name: str, config: Any) -> Tensor:
    """Where accumulate_wgrad adds a weight's grad: ``weight.main_grad`` if the attribute exists
    (Megatron's gradient_accumulation_fusion contract), else ``weight.grad`` (created as zeros when
    None, if the weight's dtype is Config.wgrad_dtype). Checked: shape, device, dtype, contiguity."""
    dtype = wgrad_dtype(config)
    if hasattr(weight, "main_grad"):
        buffer, label = weight.main_grad, f"{name}.main_grad"
    else:
        label = f"{name}.grad"
        if weight.grad is None:
            if weight.dtype != dtype:
                raise InvalidArgument(
                    name, f"accumulate_wgrad adds {dtype} grads (Config.wgrad_dtype={config.wgrad_dtype}) but "
                          f"{name} is {weight.dtype} and has no .main_grad: give it a {dtype} .main_grad buffer")
            weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        buffer = weight.grad
    check_accumulation_buffer(label, buffer, weight, config)
    return buffer


# ---- plain eager calls without the torch.library dispatch --------------------------------------

# Tests switch it off to run the ops' own path eagerly.
EAGER_BYPASS = True
# Parameters are tensors that only mark themselves as module state (their __torch_function__ is
# disabled); any other subclass may override ops and takes the ops' path.
_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def _plain_eager(tensors) -> bool:
    """Whether a call may skip torch.library's dispatch and autograd wrappers: plain tensors or
    parameters, not compiling, and nothing that traces or intercepts ops (make_fx / FakeTensor /
    other dispatch modes, torch function modes such as ``with torch.device(...)``, functorch
    transforms), no profiler that should see the op by name. Everything else takes the ops, which
    run the same engine calls with the same checks."""
    return (EAGER_BYPASS and not torch.compiler.is_compiling() and not torch.autograd.profiler._is_profiler_enabled
            and torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0
            and not torch._C._are_functorch_transforms_active() and all(type(t) in _PLAIN_TENSOR_TYPES for t in tensors))


class _EagerForward(torch.autograd.Function):
    """poise::routed_experts_forward(_clip_counts) called directly: the op's implementation, saved
    state and backward (_setup_context, _backward) under a plain autograd.Function."""

    @staticmethod
    def forward(ctx, x_TD, ids_TK, scores_TK, w13, w2, handle, w13_layout, accumulate_wgrad, clip_counts):
        result = _forward_impl(x_TD, ids_TK, scores_TK, w13, w2, handle, w13_layout, clip_counts)
        _setup_context(ctx, (x_TD, ids_TK, scores_TK, w13, w2, handle, w13_layout, accumulate_wgrad), result)
        if clip_counts:
            ctx.mark_non_differentiable(result[1])  # integers: no gradient flows back through them
        return result

    @staticmethod
    def backward(ctx, grad_out_TD, *_grad_counts):
        return (*_backward(ctx, grad_out_TD), None)


# ---- the user API --------------------------------------------------------------------------------


def _check_before_the_op(x_TD, ids_TK, scores_TK, w13, w2, context, options) -> None:
    """What the op's schema would reject less helpfully, and what only the caller knows (grad mode)."""
    if not isinstance(context, Context):
        raise InvalidArgument("context", f"must be a poise.Context, got {type(context).__name__}")
    context._require_open()
    if not isinstance(options, ExecutionOptions):
        raise InvalidArgument("options", f"must be a poise.ExecutionOptions or None, got {type(options).__name__}")
    options.validate()
    tensors = {"x_TD": x_TD, "scores_TK": scores_TK, "w13": w13, "w2": w2}
    for name, value in (("ids_TK", ids_TK), *tensors.items()):
        if not isinstance(value, Tensor):  # the op's schema would reject it with a less helpful message
            raise InvalidArgument(name, f"must be a torch.Tensor, got {type(value).__name__}")
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values())
    if wants_grad and context._cpp.config.inference:
        raise InvalidArgument("context", "was created with inference=true: run under torch.no_grad() or "
                                         "create a training context")
    if wants_grad and options.accumulate_wgrad:
        for name in ("w13", "w2"):
            weight = tensors[name]
            if weight.requires_grad and not weight.is_leaf:
                raise InvalidArgument(name, "accumulate_wgrad adds into the parameter's .main_grad/.grad, so pass "
                                            "the parameter itself (a leaf tensor), not a view or a result")


def routed_experts(
    x_TD: Tensor,
    ids_TK: Tensor,
    scores_TK: Tensor,
    w13: Tensor,
    w2: Tensor,
    context: Context,
    options: Optional[ExecutionOptions] = None,
    *,
    w13_layout: str = "gate_up_blocked",
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """The routed experts of one MoE layer on this rank: out_TD[t] = sum_k scores_TK[t,k] * expert(x_TD[t]).

    x_TD bf16 [T, D]; ids_TK int32 [T, K] global expert ids (distinct per token); scores_TK bf16 or
    fp32 [T, K]; w13 bf16 [E_local, 2, F, D] / [E_local, 2F, D] / [E_local*2F, D] (gate rows then up
    rows per expert, or interleaved with w13_layout='gate_up_interleaved'); w2 bf16 [E_local, D, F]
    / [E_local*D, F]. Returns out_TD bf16 [T, D]. Differentiable in x_TD, scores_TK, w13 and w2.
    Collective over the context's EP group. Raises poise.InvalidArgument naming the argument.
    With ``options.clip_statistics`` returns (out_TD, clip_counts): int64 [E_local, 2] on out's
    device, for each local expert the gate inputs above ``swiglu_limit`` and the up inputs outside
    [-limit, limit] over all its rows on every rank (counted on h13 as saved, bf16; zeros for
    plain SwiGLU).
    """
    options = ExecutionOptions() if options is None else options
    if torch.compiler.is_compiling():
        # Dynamo cannot trace into the C++ objects: the op's fake implementation checks instead.
        # AOTAutograd traces backward on functional tensors, not the parameters whose buffers
        # accumulate_wgrad must find.
        if options.accumulate_wgrad:
            raise NotAvailable("accumulate_wgrad under torch.compile: the weight-gradient buffers are found on the "
                               "parameters at backward time, which a compiled backward does not see; run it eagerly")
    else:
        _check_before_the_op(x_TD, ids_TK, scores_TK, w13, w2, context, options)
        if _plain_eager((x_TD, ids_TK, scores_TK, w13, w2)):
            return _EagerForward.apply(x_TD, ids_TK, scores_TK, w13, w2, context.handle, w13_layout,
                                       options.accumulate_wgrad, options.clip_statistics)
    op = (torch.ops.poise.routed_experts_forward_clip_counts if options.clip_statistics
          else torch.ops.poise.routed_experts_forward)
    return op(x_TD, ids_TK, scores_TK, w13, w2, context.handle, w13_layout, options.accumulate_wgrad)
