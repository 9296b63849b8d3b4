"""The torch.library ops poise::routed_experts_* and their fake (meta) implementations.

One-rank contexts (poise.routed_experts):

  routed_experts_forward(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout,
                         accumulate_wgrad) -> out_TD
  routed_experts_forward_clip_counts(same) -> (out_TD, clip_counts_E2)
      the forward that also counts the clamped SwiGLU's clipped inputs (int64 [E_local, 2]:
      gate > limit, |up| > limit, over every row of each local expert; zeros for plain SwiGLU)
  routed_experts_backward(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle,
                          w13_layout) -> (grad_x_TD, grad_scores_TK, grad_w13, grad_w2)
  routed_experts_backward_accumulate(..., grad_w13_acc!, grad_w2_acc!) -> (grad_x_TD, grad_scores_TK)
  routed_experts_biased_forward(x_TD, ids_TK, scores_TK, w13, w2, b13, b2, context_handle, w13_layout)
      -> out_TD: with expert biases (gpt-oss: b13 [E_local, 2F], b2 [E_local, D]); CPU contexts only
  routed_experts_biased_backward(grad_out_TD, x_TD, ..., b13, b2, context_handle, w13_layout)
      -> (grad_x_TD, grad_scores_TK, grad_w13, grad_w2, grad_b13, grad_b2)

Virtual-ranks contexts (poise.routed_experts_virtual), every tensor argument a list of one tensor
per rank in rank order:

  routed_experts_virtual_forward(x_TD[], ids_TK[], scores_TK[], w13[], w2[], context_handle,
                                 w13_layout) -> out_TD[]
  routed_experts_virtual_forward_clip_counts(same) -> (out_TD[], clip_counts_E2[])
  routed_experts_virtual_backward(grad_out_TD[], x_TD[], ..., context_handle, w13_layout)
      -> (grad_x_TD[], grad_scores_TK[], grad_w13[], grad_w2[])

The context travels as its integer handle; the context itself keeps what backward needs (the GPU
in an activation slot, the CPU reference in its engine), so forward returns out_TD only.
accumulate_wgrad is in the forward's schema because the forward's autograd saves the parameters
then (autograd.py). Real and fake implementations run the same checks (checks.py). Importing this
module registers the ops; autograd.py registers their backward. See docs/pytorch.md.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..context import Context
from .checks import (check_accumulation, check_biases, check_grad_out, check_one_rank_call, check_rank_grad_outs,
                     check_rank_lists, check_training, open_context)
from .engines import engine_of


def _clip_counts_shape(context: Context) -> tuple[int, int]:
    return (context._cpp.config.num_local_experts(context.ep_size), 2)


# ---- one rank: forward -------------------------------------------------------------------------


@torch.library.custom_op("poise::routed_experts_forward", mutates_args=())
def routed_experts_forward(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, accumulate_wgrad: bool,
) -> Tensor:
    return forward_on_engine(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, clip_counts=False)


@routed_experts_forward.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, accumulate_wgrad):
    check_one_rank_call(open_context(context_handle), x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    return torch.empty_like(x_TD)


@torch.library.custom_op("poise::routed_experts_forward_clip_counts", mutates_args=())
def routed_experts_forward_clip_counts(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, accumulate_wgrad: bool,
) -> tuple[Tensor, Tensor]:
    return forward_on_engine(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, clip_counts=True)


@routed_experts_forward_clip_counts.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, accumulate_wgrad):
    context = open_context(context_handle)
    check_one_rank_call(context, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    return torch.empty_like(x_TD), x_TD.new_empty(_clip_counts_shape(context), dtype=torch.int64)


def forward_on_engine(x_TD, ids_TK, scores_TK, w13, w2, context_handle: int, w13_layout: str, clip_counts: bool):
    """The forward ops' implementation (and the plain-eager bypass's): out_TD, or with clip_counts
    (out_TD, clip_counts_E2)."""
    context = open_context(context_handle)
    check_one_rank_call(context, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    return engine_of(context).forward(x_TD, ids_TK, scores_TK, w13, w2, w13_layout, clip_counts=clip_counts)


# ---- one rank: backward ------------------------------------------------------------------------


@torch.library.custom_op("poise::routed_experts_backward", mutates_args=())
def routed_experts_backward(
    grad_out_TD: Tensor, x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return backward_on_engine((grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout), None)


@routed_experts_backward.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout):
    _open_backward(context_handle, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    return torch.empty_like(x_TD), torch.empty_like(scores_TK), torch.empty_like(w13), torch.empty_like(w2)


@torch.library.custom_op("poise::routed_experts_backward_accumulate", mutates_args=("grad_w13_acc", "grad_w2_acc"))
def routed_experts_backward_accumulate(
    grad_out_TD: Tensor, x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, grad_w13_acc: Tensor, grad_w2_acc: Tensor,
) -> tuple[Tensor, Tensor]:
    return backward_on_engine((grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout),
                              (grad_w13_acc, grad_w2_acc))


@routed_experts_backward_accumulate.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, grad_w13_acc, grad_w2_acc):
    context = _open_backward(context_handle, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    check_accumulation(context, w13, w2, grad_w13_acc, grad_w2_acc)
    return torch.empty_like(x_TD), torch.empty_like(scores_TK)


def backward_on_engine(args: tuple, accumulate: Optional[tuple[Tensor, Tensor]], inputs_checked: bool = False):
    """The backward ops' implementation (and the plain-eager bypass's, whose forward checked the
    inputs). ``args``: (grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout).
    Returns (grad_x_TD, grad_scores_TK, grad_w13, grad_w2), or with ``accumulate`` (the two buffers
    the weight grads are added into) (grad_x_TD, grad_scores_TK)."""
    grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout = args
    context = _open_backward(context_handle, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout,
                             inputs_checked)
    if accumulate is not None:
        check_accumulation(context, w13, w2, *accumulate)
    grads = engine_of(context).backward(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout, accumulate)
    return grads if accumulate is None else grads[:2]


def _open_backward(context_handle, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout,
                   inputs_checked: bool = False) -> Context:
    context = open_context(context_handle)
    check_training(context)
    if not inputs_checked:
        check_one_rank_call(context, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    check_grad_out(context._cpp.config, context.device, grad_out_TD)
    return context


# ---- one rank with expert biases (gpt-oss) -------------------------------------------------------


def _open_biased(context_handle, x_TD, ids_TK, scores_TK, w13, w2, b13, b2, w13_layout) -> Context:
    context = open_context(context_handle)
    check_one_rank_call(context, x_TD, ids_TK, scores_TK, w13, w2, w13_layout)
    check_biases(context._cpp.config, context.ep_size, context.device, b13, b2)
    return context


@torch.library.custom_op("poise::routed_experts_biased_forward", mutates_args=())
def routed_experts_biased_forward(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor, b13: Tensor, b2: Tensor,
    context_handle: int, w13_layout: str,
) -> Tensor:
    context = _open_biased(context_handle, x_TD, ids_TK, scores_TK, w13, w2, b13, b2, w13_layout)
    return engine_of(context).forward(x_TD, ids_TK, scores_TK, w13, w2, w13_layout, biases=(b13, b2))


@routed_experts_biased_forward.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, b13, b2, context_handle, w13_layout):
    _open_biased(context_handle, x_TD, ids_TK, scores_TK, w13, w2, b13, b2, w13_layout)
    return torch.empty_like(x_TD)


@torch.library.custom_op("poise::routed_experts_biased_backward", mutates_args=())
def routed_experts_biased_backward(
    grad_out_TD: Tensor, x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor, b13: Tensor,
    b2: Tensor, context_handle: int, w13_layout: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    context = _open_biased(context_handle, x_TD, ids_TK, scores_TK, w13, w2, b13, b2, w13_layout)
    check_training(context)
    check_grad_out(context._cpp.config, context.device, grad_out_TD)
    return engine_of(context).backward(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout, None,
                                       biases=(b13, b2))


@routed_experts_biased_backward.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, b13, b2, context_handle, w13_layout):
    context = _open_biased(context_handle, x_TD, ids_TK, scores_TK, w13, w2, b13, b2, w13_layout)
    check_training(context)
    check_grad_out(context._cpp.config, context.device, grad_out_TD)
    return tuple(torch.empty_like(t) for t in (x_TD, scores_TK, w13, w2, b13, b2))


# ---- virtual ranks -------------------------------------------------------------------------------


@torch.library.custom_op("poise::routed_experts_virtual_forward", mutates_args=())
def routed_experts_virtual_forward(
    x_TD: list[Tensor], ids_TK: list[Tensor], scores_TK: list[Tensor], w13: list[Tensor], w2: list[Tensor],
    context_handle: int, w13_layout: str,
) -> list[Tensor]:
    context = open_context(context_handle)
    per_rank = check_rank_lists(context, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return engine_of(context).forward_ranks(per_rank, w13_layout)


@routed_experts_virtual_forward.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout):
    check_rank_lists(open_context(context_handle), (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return [torch.empty_like(x) for x in x_TD]


@torch.library.custom_op("poise::routed_experts_virtual_forward_clip_counts", mutates_args=())
def routed_experts_virtual_forward_clip_counts(
    x_TD: list[Tensor], ids_TK: list[Tensor], scores_TK: list[Tensor], w13: list[Tensor], w2: list[Tensor],
    context_handle: int, w13_layout: str,
) -> tuple[list[Tensor], list[Tensor]]:
    """routed_experts_virtual_forward that also returns every rank's SwiGLU clip counts."""
    context = open_context(context_handle)
    per_rank = check_rank_lists(context, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return engine_of(context).forward_ranks(per_rank, w13_layout, clip_counts=True)


@routed_experts_virtual_forward_clip_counts.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout):
    context = open_context(context_handle)
    check_rank_lists(context, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return ([torch.empty_like(x) for x in x_TD],
            [x.new_empty(_clip_counts_shape(context), dtype=torch.int64) for x in x_TD])


@torch.library.custom_op("poise::routed_experts_virtual_backward", mutates_args=())
def routed_experts_virtual_backward(
    grad_out_TD: list[Tensor], x_TD: list[Tensor], ids_TK: list[Tensor], scores_TK: list[Tensor],
    w13: list[Tensor], w2: list[Tensor], context_handle: int, w13_layout: str,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    context, per_rank = _open_virtual_backward(context_handle, grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2),
                                               w13_layout)
    return engine_of(context).backward_ranks(list(grad_out_TD), per_rank, w13_layout, None)


@routed_experts_virtual_backward.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout):
    _open_virtual_backward(context_handle, grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout)
    return ([torch.empty_like(x) for x in x_TD], [torch.empty_like(s) for s in scores_TK],
            [torch.empty_like(w) for w in w13], [torch.empty_like(w) for w in w2])


def _open_virtual_backward(context_handle, grad_out_TD, lists, w13_layout) -> tuple[Context, list[tuple]]:
    context = open_context(context_handle)
    check_training(context)
    per_rank = check_rank_lists(context, lists, w13_layout)
    check_rank_grad_outs(context, grad_out_TD)
    return context, per_rank
