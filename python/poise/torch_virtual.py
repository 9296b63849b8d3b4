"""Virtual ranks from PyTorch: every rank of an EP group in this process, one tensor per rank.

A context created with ``poise.create_context(..., ep_size=R, virtual_ranks=True)`` drives all R
ranks: on a GPU they share that device (the C++ ``Context::create_virtual_ranks``, whose calls
take one argument set per rank), on the CPU they run the reference engine. Tests, development and
single-GPU benchmarks use it; a training job runs one rank per process (poise.routed_experts).

Ops (namespace "poise"; importing this module registers them):

  routed_experts_virtual_forward(x_TD[], ids_TK[], scores_TK[], w13[], w2[], context_handle,
                                 w13_layout) -> out_TD[]
  routed_experts_virtual_backward(grad_out_TD[], x_TD[], ids_TK[], scores_TK[], w13[], w2[],
                                  context_handle, w13_layout)
      -> (grad_x_TD[], grad_scores_TK[], grad_w13[], grad_w2[])

Each list holds one tensor per rank, in rank order. See docs/pytorch.md.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from .context import Context
from .errors import InvalidArgument, NotAvailable
from .options import ExecutionOptions
from .torch_checks import check_grad_out, check_inputs, check_w13_layout
from .torch_ops import _engine, _open_context, clip_counts_shape

INPUT_NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")


def _check_lists(context: Context, lists: Sequence[Any], w13_layout: str) -> list[tuple]:
    """Validates one call's per-rank lists; returns one (x_TD, ids_TK, scores_TK, w13, w2) per rank."""
    if not context.virtual_ranks:
        raise InvalidArgument("context", "drives one rank: create it with virtual_ranks=True for "
                                         "poise.routed_experts_virtual, or call poise.routed_experts")
    check_w13_layout(w13_layout)
    ranks = context.ep_size
    for name, values in zip(INPUT_NAMES, lists):
        if not isinstance(values, (list, tuple)) or len(values) != ranks:
            got = f"{len(values)} items" if isinstance(values, (list, tuple)) else type(values).__name__
            raise InvalidArgument(name, f"must be a list of one tensor per rank ({ranks}), got {got}")
    config = context._cpp.config
    per_rank = list(zip(*lists))
    for r, inputs in enumerate(per_rank):
        check_inputs(config, ranks, context.device, *inputs, prefix=f"rank {r}: ")
    scores_dtypes = {inputs[2].dtype for inputs in per_rank}
    if len(scores_dtypes) != 1:
        raise InvalidArgument("scores_TK", f"every rank must use the same dtype, got {sorted(map(str, scores_dtypes))}")
    devices = {inputs[0].device for inputs in per_rank}
    if len(devices) != 1:  # a 'cpu' context matches any CPU tensor; virtual GPU ranks share one device
        raise InvalidArgument("x_TD", f"every rank's tensors must be on one device, got {sorted(map(str, devices))}")
    return per_rank


def _open_backward(context_handle, grad_out_TD, lists, w13_layout) -> tuple[Context, list[tuple]]:
    context = _open_context(context_handle)
    if context._cpp.config.inference:
        raise InvalidArgument("context", "was created with inference=true; backward needs a training context")
    per_rank = _check_lists(context, lists, w13_layout)
    if not isinstance(grad_out_TD, (list, tuple)) or len(grad_out_TD) != context.ep_size:
        raise InvalidArgument("grad_out_TD", f"must be a list of one tensor per rank ({context.ep_size})")
    for r, grad in enumerate(grad_out_TD):
        check_grad_out(context._cpp.config, context.device, grad, prefix=f"rank {r}: ")
    return context, per_rank


# ---- the ops -------------------------------------------------------------------------------------


@torch.library.custom_op("poise::routed_experts_virtual_forward", mutates_args=())
def routed_experts_virtual_forward(
    x_TD: list[Tensor], ids_TK: list[Tensor], scores_TK: list[Tensor], w13: list[Tensor], w2: list[Tensor],
    context_handle: int, w13_layout: str,
) -> list[Tensor]:
    context = _open_context(context_handle)
    per_rank = _check_lists(context, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return _engine(context).forward_ranks(per_rank, w13_layout)


@routed_experts_virtual_forward.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout):
    _check_lists(_open_context(context_handle), (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return [torch.empty_like(x) for x in x_TD]


@torch.library.custom_op("poise::routed_experts_virtual_forward_clip_counts", mutates_args=())
def routed_experts_virtual_forward_clip_counts(
    x_TD: list[Tensor], ids_TK: list[Tensor], scores_TK: list[Tensor], w13: list[Tensor], w2: list[Tensor],
    context_handle: int, w13_layout: str,
) -> tuple[list[Tensor], list[Tensor]]:
    """routed_experts_virtual_forward that also returns every rank's SwiGLU clip counts."""
    context = _open_context(context_handle)
    per_rank = _check_lists(context, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return _engine(context).forward_ranks(per_rank, w13_layout, clip_counts=True)


@routed_experts_virtual_forward_clip_counts.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout):
    context = _open_context(context_handle)
    _check_lists(context, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return ([torch.empty_like(x) for x in x_TD],
            [x.new_empty(clip_counts_shape(context), dtype=torch.int64) for x in x_TD])


@torch.library.custom_op("poise::routed_experts_virtual_backward", mutates_args=())
def routed_experts_virtual_backward(
    grad_out_TD: list[Tensor], x_TD: list[Tensor], ids_TK: list[Tensor], scores_TK: list[Tensor],
    w13: list[Tensor], w2: list[Tensor], context_handle: int, w13_layout: str,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    context, per_rank = _open_backward(context_handle, grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return _engine(context).backward_ranks(list(grad_out_TD), per_rank, w13_layout, None)


@routed_experts_virtual_backward.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout):
    _open_backward(context_handle, grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return ([torch.empty_like(x) for x in x_TD], [torch.empty_like(s) for s in scores_TK],
            [torch.empty_like(w) for w in w13], [torch.empty_like(w) for w in w2])


# ---- autograd ------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    x_TD, ids_TK, scores_TK, w13, w2, handle, w13_layout = inputs
    ranks = len(x_TD)
    ctx.ranks = ranks
    ctx.save_for_backward(*x_TD, *ids_TK, *scores_TK, *w13, *w2)
    # Per differentiable list, which ranks' tensors want a grad (needs_input_grad is flattened in
    # an order this code should not depend on).
    ctx.wants = [[t.requires_grad for t in tensors] for tensors in (x_TD, scores_TK, w13, w2)]
    ctx.context_handle, ctx.w13_layout = handle, w13_layout


def _backward(ctx, grad_out_TD):
    saved, R = ctx.saved_tensors, ctx.ranks
    x_TD, ids_TK, scores_TK, w13, w2 = (list(saved[i * R:(i + 1) * R]) for i in range(5))
    # A rank whose output did not reach the loss may get None; autograd may hand strided grads.
    grad_out_TD = [torch.zeros_like(x) if g is None else g.contiguous() for g, x in zip(grad_out_TD, x_TD)]
    grads = torch.ops.poise.routed_experts_virtual_backward(
        grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, ctx.context_handle, ctx.w13_layout)
    grad_x, grad_scores, grad_w13, grad_w2 = (
        [g if want else None for g, want in zip(per_rank, wants)] for per_rank, wants in zip(grads, ctx.wants))
    return grad_x, [None] * R, grad_scores, grad_w13, grad_w2, None, None


torch.library.register_autograd("poise::routed_experts_virtual_forward", _backward, setup_context=_setup_context)
torch.library.register_autograd("poise::routed_experts_virtual_forward_clip_counts",
                                lambda ctx, grad_out_TD, _grad_counts: _backward(ctx, grad_out_TD),
                                setup_context=_setup_context)


# ---- the user API --------------------------------------------------------------------------------


def routed_experts_virtual(
    x_TD: Sequence[Tensor],
    ids_TK: Sequence[Tensor],
    scores_TK: Sequence[Tensor],
    w13: Sequence[Tensor],
    w2: Sequence[Tensor],
    context: Context,
    options: Optional[ExecutionOptions] = None,
    *,
    w13_layout: str = "gate_up_blocked",
) -> Union[list[Tensor], tuple[list[Tensor], list[Tensor]]]:
    """poise.routed_experts for every rank of a virtual-ranks context: each argument is a list of
    one tensor per rank (rank order, shapes and dtypes of poise.routed_experts); returns each rank's
    out_TD. Differentiable in every rank's x_TD, scores_TK, w13 and w2 (one backward call runs all
    ranks, as the ranks' backwards are collective). Raises poise.InvalidArgument naming the argument
    (with 'rank r: ' for a per-rank tensor). With ``options.clip_statistics`` returns (outs,
    clip_counts): one int64 [E_local, 2] per rank, as poise.routed_experts documents."""
    options = ExecutionOptions() if options is None else options
    if not isinstance(options, ExecutionOptions):
        raise InvalidArgument("options", f"must be a poise.ExecutionOptions or None, got {type(options).__name__}")
    options.validate()
    if options.accumulate_wgrad:
        raise NotAvailable("accumulate_wgrad with virtual ranks: not wired to Python in this build "
                           "(use poise.routed_experts on a one-rank context, or poise.reference.Engine's accumulate_into)")
    if not isinstance(context, Context):
        raise InvalidArgument("context", f"must be a poise.Context, got {type(context).__name__}")
    context._require_open()
    lists = [list(v) if isinstance(v, (list, tuple)) else v for v in (x_TD, ids_TK, scores_TK, w13, w2)]
    if not torch.compiler.is_compiling():
        _check_lists(context, lists, w13_layout)  # before the op: its schema would reject less helpfully
        wants_grad = torch.is_grad_enabled() and any(
            t.requires_grad for name, tensors in zip(INPUT_NAMES, lists) if name != "ids_TK" for t in tensors)
        if wants_grad and context._cpp.config.inference:
            raise InvalidArgument("context", "was created with inference=true: run under torch.no_grad() or "
                                             "create a training context")
    op = (torch.ops.poise.routed_experts_virtual_forward_clip_counts if options.clip_statistics
          else torch.ops.poise.routed_experts_virtual_forward)
    return op(*lists, context.handle, w13_layout)
