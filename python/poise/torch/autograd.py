"""Autograd of the forward ops, and the plain-eager bypass of torch.library's dispatch.

Backward of a one-rank forward runs poise::routed_experts_backward, or with accumulate_wgrad
poise::routed_experts_backward_accumulate, which adds the weight grads into the parameters'
``.main_grad`` / ``.grad`` in place (autograd then gets None for w13 and w2); with expert biases
the routed_experts_biased_* twins, which do the same for b13 and b2; a forward with prepared FP8
weights (routed_experts_prepared_*) has the backward of its five tensors. Backward of a
virtual-ranks forward runs poise::routed_experts_virtual_backward for every rank at once.

The plain-eager bypass: an eager call on plain tensors gains nothing from torch.library's dispatch
and autograd wrappers but their host time, so ``EagerForward`` runs the same engine calls, checks,
saved state and backward under a plain autograd.Function. Anything that traces or intercepts ops
takes the ops.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..context import context_from_handle
from ..errors import InvalidArgument
from . import ops  # the ops whose autograd is registered here; the bypass runs their implementation
from .checks import check_accumulation_buffer, wgrad_dtype

# ---- one rank, with or without expert biases -----------------------------------------------------
# The forward ops' inputs: the tensors (x_TD, ids_TK, scores_TK, w13, w2[, b13, b2]), then
# (context_handle, w13_layout, weights_transposed, accumulate_wgrad).

_NON_TENSOR_INPUTS = 4


def _setup_one_rank(ctx, inputs, output) -> None:
    *tensors, handle, w13_layout, weights_transposed, accumulate_wgrad = inputs
    ctx.save_for_backward(*tensors)
    # The handle, not the Context: an autograd graph kept alive (say, until interpreter exit) must
    # not keep the context's buffers alive with it. Backward finds the context by its handle.
    ctx.call = (handle, w13_layout, weights_transposed)
    # With accumulation the parameters themselves are needed: their .main_grad / .grad.
    ctx.parameters = tuple(tensors[3:]) if accumulate_wgrad else None
    ctx.prepared_t = None  # the prepared forwards' transposed FP8 copies, for DGRAD (_setup_prepared)


def _tensor_grads(ctx, grad_out_TD, needs: Sequence[bool]) -> tuple:
    """The grads of the forward's tensors (None for ids_TK and for what is not needed)."""
    tensors = ctx.saved_tensors
    # Autograd may hand a broadcast (stride 0) or otherwise strided gradient: the ops need rows.
    grad_out_TD = grad_out_TD.contiguous()
    if ctx.parameters is None:
        grad_x, grad_scores, *parameter_grads = run_backward(grad_out_TD, tensors, ctx.call, None, ctx.prepared_t)
    else:
        buffers = _accumulation_buffers(ctx.parameters, ctx.call[0], needs[3:])
        grad_x, grad_scores = run_backward(grad_out_TD, tensors, ctx.call, buffers, ctx.prepared_t)
        parameter_grads = [None] * len(ctx.parameters)  # already added into the buffers: not again by autograd
    grads = (grad_x, None, grad_scores, *parameter_grads)
    return tuple(g if need else None for g, need in zip(grads, needs))


def _backward_one_rank(ctx, grad_out_TD, *_grad_counts):
    # The counts of the clip-counting forwards are integers: no gradient flows back through them.
    needs = ctx.needs_input_grad[:-_NON_TENSOR_INPUTS]
    return (*_tensor_grads(ctx, grad_out_TD, needs), *[None] * _NON_TENSOR_INPUTS)


_BACKWARD_OPS = {  # (biased, accumulating): the backward op
    (False, False): "routed_experts_backward", (False, True): "routed_experts_backward_accumulate",
    (True, False): "routed_experts_biased_backward", (True, True): "routed_experts_biased_backward_accumulate",
}


def run_backward(grad_out_TD: Tensor, tensors: Sequence[Tensor], call: tuple,
                 accumulate: Optional[Sequence[Tensor]], prepared_t: Optional[Sequence[Tensor]] = None) -> tuple:
    """The backward op of a forward's ``tensors`` and ``call`` (context_handle, w13_layout,
    weights_transposed) and of the accumulation buffers, or in plain eager mode its engine call
    directly. The inputs were checked by the forward whose graph this is (autograd refuses saved
    tensors modified in place since), so only grad_out and the buffers are checked here.
    ``prepared_t``: the prepared transposed FP8 copies DGRAD reads (one rank, no biases), or None."""
    handle, w13_layout, weights_transposed = call
    buffers = tuple(accumulate or ())
    # Grad mode on in a backward means create_graph=True: the ops' autograd fallback marks what a
    # second differentiation cannot go through; a direct call would hand back plain tensors.
    if torch.is_grad_enabled() or not plain_eager((grad_out_TD, *tensors, *buffers, *(prepared_t or ()))):
        op = getattr(torch.ops.poise, _BACKWARD_OPS[(len(tensors) > 5, accumulate is not None)])
        return op(grad_out_TD, *tensors, handle, w13_layout, weights_transposed, *buffers, *(prepared_t or ()))
    return ops.backward_on_engine(grad_out_TD, tensors, handle, w13_layout, weights_transposed, accumulate,
                                  inputs_checked=True, prepared_t=prepared_t)


def _accumulation_buffers(parameters: tuple[Tensor, ...], handle: int, needs: Sequence[bool]) -> tuple:
    """Where the weight (and bias) grads are added: the parameters' buffers, or scratch zeros for a
    parameter whose grad is not wanted (the kernels write them all)."""
    config = context_from_handle(handle)._cpp.config
    return tuple(accumulation_buffer(parameter, name, config) if need
                 else torch.zeros_like(parameter, dtype=wgrad_dtype(config))
                 for parameter, name, need in zip(parameters, ("w13", "w2", "b13", "b2"), needs))


def accumulation_buffer(weight: Tensor, name: str, config: Any) -> Tensor:
    """Where accumulate_wgrad adds a weight's (or bias's) grad: ``weight.main_grad`` if the
    attribute exists (Megatron's gradient_accumulation_fusion contract), else ``weight.grad``
    (created as zeros when None, if the weight's dtype is Config.wgrad_dtype). Checked: shape,
    device, dtype, contiguity."""
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


for _name in ("routed_experts_forward", "routed_experts_forward_clip_counts", "routed_experts_biased_forward",
              "routed_experts_biased_forward_clip_counts"):
    torch.library.register_autograd(f"poise::{_name}", _backward_one_rank, setup_context=_setup_one_rank)


# ---- one rank with prepared FP8 weights ----------------------------------------------------------
# The inputs: the five tensors, the four prepared ones (read by the forward only: neither saved nor
# differentiated), the non-tensor inputs, then optionally the four transposed copies DGRAD reads
# (kept for the backward, not differentiated). Backward is the five tensors' (routed_experts_backward).

_PREPARED_INPUTS = 4


def _setup_prepared(ctx, inputs, output) -> None:
    non_tensor_end = 5 + _PREPARED_INPUTS + _NON_TENSOR_INPUTS
    _setup_one_rank(ctx, (*inputs[:5], *inputs[5 + _PREPARED_INPUTS:non_tensor_end]), output)
    transposed = tuple(inputs[non_tensor_end:])
    ctx.prepared_t = transposed if transposed and transposed[0] is not None else None
    ctx.num_inputs = len(inputs)


def _backward_prepared(ctx, grad_out_TD, *_grad_counts):
    grads = _tensor_grads(ctx, grad_out_TD, ctx.needs_input_grad[:5])
    return (*grads, *[None] * (ctx.num_inputs - 5))


for _name in ("routed_experts_prepared_forward", "routed_experts_prepared_forward_clip_counts"):
    torch.library.register_autograd(f"poise::{_name}", _backward_prepared, setup_context=_setup_prepared)


# ---- virtual ranks -------------------------------------------------------------------------------


def _setup_virtual(ctx, inputs, output) -> None:
    x_TD, ids_TK, scores_TK, w13, w2, handle, w13_layout, weights_transposed = inputs
    ctx.ranks = len(x_TD)
    ctx.save_for_backward(*x_TD, *ids_TK, *scores_TK, *w13, *w2)
    # Per differentiable list, which ranks' tensors want a grad (needs_input_grad is flattened in
    # an order this code should not depend on).
    ctx.wants = [[t.requires_grad for t in tensors] for tensors in (x_TD, scores_TK, w13, w2)]
    ctx.call = (handle, w13_layout, weights_transposed)


def _backward_virtual(ctx, grad_out_TD):
    saved, R = ctx.saved_tensors, ctx.ranks
    x_TD, ids_TK, scores_TK, w13, w2 = (list(saved[i * R:(i + 1) * R]) for i in range(5))
    # A rank whose output did not reach the loss may get None; autograd may hand strided grads.
    grad_out_TD = [torch.zeros_like(x) if g is None else g.contiguous() for g, x in zip(grad_out_TD, x_TD)]
    grads = torch.ops.poise.routed_experts_virtual_backward(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, *ctx.call)
    grad_x, grad_scores, grad_w13, grad_w2 = (
        [g if want else None for g, want in zip(per_rank, wants)] for per_rank, wants in zip(grads, ctx.wants))
    return grad_x, [None] * R, grad_scores, grad_w13, grad_w2, None, None, None


torch.library.register_autograd("poise::routed_experts_virtual_forward", _backward_virtual,
                                setup_context=_setup_virtual)
torch.library.register_autograd("poise::routed_experts_virtual_forward_clip_counts",
                                lambda ctx, grad_out_TD, _grad_counts: _backward_virtual(ctx, grad_out_TD),
                                setup_context=_setup_virtual)


# ---- plain eager calls without the torch.library dispatch ----------------------------------------

# Tests switch it off to run the ops' own path eagerly.
EAGER_BYPASS = True
# Parameters are tensors that only mark themselves as module state (their __torch_function__ is
# disabled); any other subclass may override ops and takes the ops' path.
_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def plain_eager(tensors) -> bool:
    """Whether a call may skip torch.library's dispatch and autograd wrappers: plain tensors or
    parameters, not compiling, and nothing that traces or intercepts ops (make_fx / FakeTensor /
    other dispatch modes, torch function modes such as ``with torch.device(...)``, functorch
    transforms), no profiler that should see the op by name. Everything else takes the ops, which
    run the same engine calls with the same checks."""
    return (EAGER_BYPASS and not torch.compiler.is_compiling() and not torch.autograd.profiler._is_profiler_enabled
            and torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0
            and not torch._C._are_functorch_transforms_active()
            and all(type(t) in _PLAIN_TENSOR_TYPES for t in tensors))


class EagerCall(NamedTuple):
    """What an eager call carries besides its tensors."""

    context_handle: int
    w13_layout: str
    accumulate_wgrad: bool
    weights_transposed: bool
    clip_counts: bool
    sync_check: bool
    # Prepared FP8 weights (checks.PREPARED_FIELDS' order), read by the forward only: not inputs of
    # the autograd.Function (no grads, not saved); their transposed copies (PREPARED_T_FIELDS'), kept
    # for the backward's DGRAD.
    prepared: Optional[tuple[Tensor, ...]] = None
    prepared_t: Optional[tuple[Tensor, ...]] = None


def eager_forward_on_engine(call: EagerCall, tensors: Sequence[Tensor]):
    """The engine call of an eager forward: EagerForward's, and alone when no grad is wanted
    (inference, torch.no_grad: no autograd node or saved state, whose host time is what a decode step
    costs)."""
    return ops.forward_on_engine(tensors, call.context_handle, call.w13_layout, call.weights_transposed,
                                 call.clip_counts, call.prepared, call.prepared_t)


class EagerForward(torch.autograd.Function):
    """poise::routed_experts_(biased_)forward(_clip_counts) called directly: the op's implementation,
    saved state and backward (_setup_one_rank, _tensor_grads) under a plain autograd.Function.
    ``apply(call, x_TD, ids_TK, scores_TK, w13, w2[, b13, b2])``; prepared FP8 weights travel in
    ``call.prepared``."""

    @staticmethod
    def forward(ctx, call: EagerCall, *tensors):
        result = eager_forward_on_engine(call, tensors)
        _setup_one_rank(ctx, (*tensors, call.context_handle, call.w13_layout, call.weights_transposed,
                              call.accumulate_wgrad), result)
        ctx.prepared_t = call.prepared_t
        ctx.sync_check = call.sync_check
        if call.clip_counts:
            ctx.mark_non_differentiable(result[1])  # integers: no gradient flows back through them
        return result

    @staticmethod
    def backward(ctx, grad_out_TD, *_grad_counts):
        grads = _tensor_grads(ctx, grad_out_TD, ctx.needs_input_grad[1:])
        if ctx.sync_check and not torch.cuda.is_current_stream_capturing():
            context_from_handle(ctx.call[0]).check()  # ExecutionOptions.sync_check
        return (None, *grads)
