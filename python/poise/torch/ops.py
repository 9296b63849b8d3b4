"""The torch.library ops poise::routed_experts_* and their fake (meta) implementations.

One-rank contexts (poise.routed_experts); ``weights_transposed``: w13 [E_local, D, 2F] and w2
[E_local, F, D], the weights as stored for x @ W (gpt-oss), else [E_local, 2F, D] / [E_local, D, F]:

  routed_experts_forward(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout,
                         weights_transposed, accumulate_wgrad) -> out_TD
  routed_experts_forward_clip_counts(same) -> (out_TD, clip_counts_E2)
      the forward that also counts the clamped SwiGLU's clipped inputs (int64 [E_local, 2]:
      gate > limit, |up| > limit, over every row of each local expert; zeros for plain SwiGLU)
  routed_experts_backward(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle,
                          w13_layout, weights_transposed) -> (grad_x_TD, grad_scores_TK, grad_w13, grad_w2)
  routed_experts_backward_accumulate(..., weights_transposed, grad_w13_acc!, grad_w2_acc!)
      -> (grad_x_TD, grad_scores_TK)

  With expert biases (gpt-oss: b13 [E_local, 2F], b2 [E_local, D]) after w2, the same four:
  routed_experts_biased_forward(x_TD, ..., w2, b13, b2, context_handle, w13_layout, weights_transposed,
                                accumulate_wgrad) -> out_TD
  routed_experts_biased_forward_clip_counts(same) -> (out_TD, clip_counts_E2)
  routed_experts_biased_backward(grad_out_TD, x_TD, ..., b13, b2, context_handle, w13_layout,
                                 weights_transposed)
      -> (grad_x_TD, grad_scores_TK, grad_w13, grad_w2, grad_b13, grad_b2)
  routed_experts_biased_backward_accumulate(..., weights_transposed, grad_w13_acc!, grad_w2_acc!,
                                            grad_b13_acc!, grad_b2_acc!) -> (grad_x_TD, grad_scores_TK)

  With prepared FP8 weights (poise.prepare_weights: w13_fp8 e4m3 in w13's shape, w13_fp8_scales fp32
  [E_local, ceil(2F/128), ceil(D/128)], w2_fp8, w2_fp8_scales likewise) after w2, gemm_precision
  'fp8_block_scaled' contexts only, the forwards; their backward is routed_experts_backward(_accumulate)
  of the five tensors (the prepared weights are read by the forward only):
  routed_experts_prepared_forward(x_TD, ..., w2, w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales,
                                  context_handle, w13_layout, weights_transposed, accumulate_wgrad) -> out_TD
  routed_experts_prepared_forward_clip_counts(same) -> (out_TD, clip_counts_E2)

Virtual-ranks contexts (poise.routed_experts_virtual), every tensor argument a list of one tensor
per rank in rank order:

  routed_experts_virtual_forward(x_TD[], ids_TK[], scores_TK[], w13[], w2[], context_handle,
                                 w13_layout, weights_transposed) -> out_TD[]
  routed_experts_virtual_forward_clip_counts(same) -> (out_TD[], clip_counts_E2[])
  routed_experts_virtual_backward(grad_out_TD[], x_TD[], ..., context_handle, w13_layout,
                                  weights_transposed)
      -> (grad_x_TD[], grad_scores_TK[], grad_w13[], grad_w2[])

No argument has a default: torch.library's autograd leaves an argument passed at its default out
of the inputs it checks backward's grads against.
The context travels as its integer handle; the context itself keeps what backward needs (the GPU
in an activation slot, the CPU reference in its engine), so forward returns out_TD only.
accumulate_wgrad is in the forward's schema because the forward's autograd saves the parameters
then (autograd.py). Real and fake implementations run the same checks (checks.py). Importing this
module registers the ops; autograd.py registers their backward. See docs/pytorch.md.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..context import Context
from .checks import (check_accumulation, check_biases, check_grad_out, check_one_rank_call, check_prepared,
                     check_rank_grad_outs, check_rank_lists, check_training, open_context)
from .engines import engine_of


def _clip_counts_shape(context: Context) -> tuple[int, int]:
    return (context._cpp.config.num_local_experts(context.ep_size), 2)


# ---- one rank: what every one-rank op runs -------------------------------------------------------
# ``tensors``: (x_TD, ids_TK, scores_TK, w13, w2), or with expert biases (..., b13, b2).


def forward_on_engine(tensors: Sequence[Tensor], context_handle: int, w13_layout: str, weights_transposed: bool,
                      clip_counts: bool, prepared: Optional[Sequence[Tensor]] = None,
                      prepared_t: Optional[Sequence[Tensor]] = None):
    """The forward ops' implementation (and the plain-eager bypass's): out_TD, or with clip_counts
    (out_TD, clip_counts_E2). ``prepared``: the prepared FP8 weights (checks.PREPARED_FIELDS' order),
    or None; ``prepared_t``: their transposed copies for the backward (checked here, read there)."""
    context = _open_call(context_handle, tensors, w13_layout, weights_transposed, prepared)
    if prepared_t is not None:
        check_prepared(context, weights_transposed, prepared_t, transposed=True)
    x_TD, ids_TK, scores_TK, w13, w2, *biases = tensors
    # Only a CUDA engine takes prepared weights (check_prepared refuses them on a CPU context).
    extra = {} if prepared is None else {"prepared": tuple(prepared)}
    return engine_of(context).forward(x_TD, ids_TK, scores_TK, w13, w2, w13_layout, clip_counts=clip_counts,
                                      biases=tuple(biases) or None, weights_transposed=weights_transposed, **extra)


def backward_on_engine(grad_out_TD: Tensor, tensors: Sequence[Tensor], context_handle: int, w13_layout: str,
                       weights_transposed: bool, accumulate: Optional[Sequence[Tensor]],
                       inputs_checked: bool = False, prepared_t: Optional[Sequence[Tensor]] = None):
    """The backward ops' implementation (and the plain-eager bypass's, whose forward checked the
    inputs). Returns (grad_x_TD, grad_scores_TK, grad_w13, grad_w2[, grad_b13, grad_b2]), or with
    ``accumulate`` (the buffers the weight and bias grads are added into) (grad_x_TD, grad_scores_TK).
    ``prepared_t``: the weights' prepared transposed FP8 copies (checks.PREPARED_T_FIELDS' order), or None."""
    context = _open_backward(context_handle, grad_out_TD, tensors, w13_layout, weights_transposed, inputs_checked)
    if accumulate is not None:
        check_accumulation(context, tensors[3:], accumulate)
    x_TD, ids_TK, scores_TK, w13, w2, *biases = tensors
    extra = {}
    if prepared_t is not None:  # only a CUDA engine takes them (check_prepared refuses them on a CPU context)
        check_prepared(context, weights_transposed, prepared_t, transposed=True)
        extra = {"prepared_t": tuple(prepared_t)}
    grads = engine_of(context).backward(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout,
                                        None if accumulate is None else tuple(accumulate),
                                        biases=tuple(biases) or None, weights_transposed=weights_transposed, **extra)
    return grads if accumulate is None else grads[:2]


def _open_call(context_handle: int, tensors: Sequence[Tensor], w13_layout: str, weights_transposed: bool,
               prepared: Optional[Sequence[Tensor]] = None) -> Context:
    context = open_context(context_handle)
    check_one_rank_call(context, *tensors[:5], w13_layout, weights_transposed)
    if len(tensors) > 5:
        check_biases(context._cpp.config, context.ep_size, context.device, *tensors[5:])
    if prepared is not None:
        check_prepared(context, weights_transposed, prepared)
    return context


def _open_backward(context_handle: int, grad_out_TD: Tensor, tensors: Sequence[Tensor], w13_layout: str,
                   weights_transposed: bool, inputs_checked: bool = False) -> Context:
    context = (open_context(context_handle) if inputs_checked
               else _open_call(context_handle, tensors, w13_layout, weights_transposed))
    check_training(context)
    check_grad_out(context._cpp.config, context.device, grad_out_TD)
    return context


def _fake_forward(tensors, context_handle, w13_layout, weights_transposed, clip_counts: bool, prepared=None,
                  prepared_t=None):
    context = _open_call(context_handle, tensors, w13_layout, weights_transposed, prepared)
    if prepared_t is not None:
        check_prepared(context, weights_transposed, prepared_t, transposed=True)
    out = torch.empty_like(tensors[0])
    return (out, out.new_empty(_clip_counts_shape(context), dtype=torch.int64)) if clip_counts else out


def _fake_backward(grad_out_TD, tensors, context_handle, w13_layout, weights_transposed, accumulate,
                   prepared_t=None):
    context = _open_backward(context_handle, grad_out_TD, tensors, w13_layout, weights_transposed)
    if prepared_t is not None:
        check_prepared(context, weights_transposed, prepared_t, transposed=True)
    if accumulate is not None:
        check_accumulation(context, tensors[3:], accumulate)
        return torch.empty_like(tensors[0]), torch.empty_like(tensors[2])
    return tuple(torch.empty_like(t) for i, t in enumerate(tensors) if i != 1)  # no grad for ids_TK


# ---- one rank ------------------------------------------------------------------------------------


@torch.library.custom_op("poise::routed_experts_forward", mutates_args=())
def routed_experts_forward(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, weights_transposed: bool, accumulate_wgrad: bool,
) -> Tensor:
    return forward_on_engine((x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout, weights_transposed,
                             clip_counts=False)


@routed_experts_forward.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, weights_transposed, accumulate_wgrad):
    return _fake_forward((x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout, weights_transposed, False)


@torch.library.custom_op("poise::routed_experts_forward_clip_counts", mutates_args=())
def routed_experts_forward_clip_counts(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, weights_transposed: bool, accumulate_wgrad: bool,
) -> tuple[Tensor, Tensor]:
    return forward_on_engine((x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout, weights_transposed,
                             clip_counts=True)


@routed_experts_forward_clip_counts.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, weights_transposed, accumulate_wgrad):
    return _fake_forward((x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout, weights_transposed, True)


def _prepared_t(w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales) -> Optional[tuple]:
    """The backward ops' optional prepared transposed copies: all four, or None (check_prepared
    names the missing one)."""
    tensors = (w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales)
    return None if all(t is None for t in tensors) else tensors


@torch.library.custom_op("poise::routed_experts_backward", mutates_args=())
def routed_experts_backward(
    grad_out_TD: Tensor, x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, weights_transposed: bool, w13_fp8_t: Optional[Tensor] = None,
    w13_fp8_t_scales: Optional[Tensor] = None, w2_fp8_t: Optional[Tensor] = None,
    w2_fp8_t_scales: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return backward_on_engine(grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout,
                              weights_transposed, None,
                              prepared_t=_prepared_t(w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales))


@routed_experts_backward.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, weights_transposed, w13_fp8_t=None,
      w13_fp8_t_scales=None, w2_fp8_t=None, w2_fp8_t_scales=None):
    return _fake_backward(grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout,
                          weights_transposed, None, _prepared_t(w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales))


@torch.library.custom_op("poise::routed_experts_backward_accumulate", mutates_args=("grad_w13_acc", "grad_w2_acc"))
def routed_experts_backward_accumulate(
    grad_out_TD: Tensor, x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor,
    context_handle: int, w13_layout: str, weights_transposed: bool, grad_w13_acc: Tensor, grad_w2_acc: Tensor,
    w13_fp8_t: Optional[Tensor] = None, w13_fp8_t_scales: Optional[Tensor] = None, w2_fp8_t: Optional[Tensor] = None,
    w2_fp8_t_scales: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    return backward_on_engine(grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout,
                              weights_transposed, (grad_w13_acc, grad_w2_acc),
                              prepared_t=_prepared_t(w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales))


@routed_experts_backward_accumulate.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, weights_transposed, grad_w13_acc,
      grad_w2_acc, w13_fp8_t=None, w13_fp8_t_scales=None, w2_fp8_t=None, w2_fp8_t_scales=None):
    return _fake_backward(grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout,
                          weights_transposed, (grad_w13_acc, grad_w2_acc),
                          _prepared_t(w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales))


# ---- one rank with expert biases (gpt-oss) -------------------------------------------------------


@torch.library.custom_op("poise::routed_experts_biased_forward", mutates_args=())
def routed_experts_biased_forward(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor, b13: Tensor, b2: Tensor,
    context_handle: int, w13_layout: str, weights_transposed: bool, accumulate_wgrad: bool,
) -> Tensor:
    return forward_on_engine((x_TD, ids_TK, scores_TK, w13, w2, b13, b2), context_handle, w13_layout,
                             weights_transposed, clip_counts=False)


@routed_experts_biased_forward.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, b13, b2, context_handle, w13_layout, weights_transposed,
      accumulate_wgrad):
    return _fake_forward((x_TD, ids_TK, scores_TK, w13, w2, b13, b2), context_handle, w13_layout, weights_transposed,
                         False)


@torch.library.custom_op("poise::routed_experts_biased_forward_clip_counts", mutates_args=())
def routed_experts_biased_forward_clip_counts(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor, b13: Tensor, b2: Tensor,
    context_handle: int, w13_layout: str, weights_transposed: bool, accumulate_wgrad: bool,
) -> tuple[Tensor, Tensor]:
    return forward_on_engine((x_TD, ids_TK, scores_TK, w13, w2, b13, b2), context_handle, w13_layout,
                             weights_transposed, clip_counts=True)


@routed_experts_biased_forward_clip_counts.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, b13, b2, context_handle, w13_layout, weights_transposed,
      accumulate_wgrad):
    return _fake_forward((x_TD, ids_TK, scores_TK, w13, w2, b13, b2), context_handle, w13_layout, weights_transposed,
                         True)


@torch.library.custom_op("poise::routed_experts_biased_backward", mutates_args=())
def routed_experts_biased_backward(
    grad_out_TD: Tensor, x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor, b13: Tensor,
    b2: Tensor, context_handle: int, w13_layout: str, weights_transposed: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return backward_on_engine(grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2, b13, b2), context_handle, w13_layout,
                              weights_transposed, None)


@routed_experts_biased_backward.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, b13, b2, context_handle, w13_layout, weights_transposed):
    return _fake_backward(grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2, b13, b2), context_handle, w13_layout,
                          weights_transposed, None)


@torch.library.custom_op("poise::routed_experts_biased_backward_accumulate",
                         mutates_args=("grad_w13_acc", "grad_w2_acc", "grad_b13_acc", "grad_b2_acc"))
def routed_experts_biased_backward_accumulate(
    grad_out_TD: Tensor, x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor, b13: Tensor,
    b2: Tensor, context_handle: int, w13_layout: str, weights_transposed: bool, grad_w13_acc: Tensor,
    grad_w2_acc: Tensor, grad_b13_acc: Tensor, grad_b2_acc: Tensor,
) -> tuple[Tensor, Tensor]:
    return backward_on_engine(grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2, b13, b2), context_handle, w13_layout,
                              weights_transposed, (grad_w13_acc, grad_w2_acc, grad_b13_acc, grad_b2_acc))


@routed_experts_biased_backward_accumulate.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, b13, b2, context_handle, w13_layout, weights_transposed,
      grad_w13_acc, grad_w2_acc, grad_b13_acc, grad_b2_acc):
    return _fake_backward(grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2, b13, b2), context_handle, w13_layout,
                          weights_transposed, (grad_w13_acc, grad_w2_acc, grad_b13_acc, grad_b2_acc))


# ---- one rank with prepared FP8 weights (gemm_precision fp8_block_scaled) ------------------------
# Backward: routed_experts_backward(_accumulate) of the five tensors (autograd.py).


@torch.library.custom_op("poise::routed_experts_prepared_forward", mutates_args=())
def routed_experts_prepared_forward(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor, w13_fp8: Tensor,
    w13_fp8_scales: Tensor, w2_fp8: Tensor, w2_fp8_scales: Tensor,
    context_handle: int, w13_layout: str, weights_transposed: bool, accumulate_wgrad: bool,
    w13_fp8_t: Optional[Tensor] = None, w13_fp8_t_scales: Optional[Tensor] = None, w2_fp8_t: Optional[Tensor] = None,
    w2_fp8_t_scales: Optional[Tensor] = None,
) -> Tensor:
    return forward_on_engine((x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout, weights_transposed,
                             clip_counts=False, prepared=(w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales),
                             prepared_t=_prepared_t(w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales))


@routed_experts_prepared_forward.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales, context_handle, w13_layout,
      weights_transposed, accumulate_wgrad, w13_fp8_t=None, w13_fp8_t_scales=None, w2_fp8_t=None, w2_fp8_t_scales=None):
    return _fake_forward((x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout, weights_transposed, False,
                         (w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales),
                         _prepared_t(w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales))


@torch.library.custom_op("poise::routed_experts_prepared_forward_clip_counts", mutates_args=())
def routed_experts_prepared_forward_clip_counts(
    x_TD: Tensor, ids_TK: Tensor, scores_TK: Tensor, w13: Tensor, w2: Tensor, w13_fp8: Tensor,
    w13_fp8_scales: Tensor, w2_fp8: Tensor, w2_fp8_scales: Tensor,
    context_handle: int, w13_layout: str, weights_transposed: bool, accumulate_wgrad: bool,
    w13_fp8_t: Optional[Tensor] = None, w13_fp8_t_scales: Optional[Tensor] = None, w2_fp8_t: Optional[Tensor] = None,
    w2_fp8_t_scales: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    return forward_on_engine((x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout, weights_transposed,
                             clip_counts=True, prepared=(w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales),
                             prepared_t=_prepared_t(w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales))


@routed_experts_prepared_forward_clip_counts.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales, context_handle, w13_layout,
      weights_transposed, accumulate_wgrad, w13_fp8_t=None, w13_fp8_t_scales=None, w2_fp8_t=None, w2_fp8_t_scales=None):
    return _fake_forward((x_TD, ids_TK, scores_TK, w13, w2), context_handle, w13_layout, weights_transposed, True,
                         (w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales),
                         _prepared_t(w13_fp8_t, w13_fp8_t_scales, w2_fp8_t, w2_fp8_t_scales))


# ---- virtual ranks -------------------------------------------------------------------------------


@torch.library.custom_op("poise::routed_experts_virtual_forward", mutates_args=())
def routed_experts_virtual_forward(
    x_TD: list[Tensor], ids_TK: list[Tensor], scores_TK: list[Tensor], w13: list[Tensor], w2: list[Tensor],
    context_handle: int, w13_layout: str, weights_transposed: bool,
) -> list[Tensor]:
    context = open_context(context_handle)
    per_rank = check_rank_lists(context, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout, weights_transposed)
    return engine_of(context).forward_ranks(per_rank, w13_layout, weights_transposed=weights_transposed)


@routed_experts_virtual_forward.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, weights_transposed):
    check_rank_lists(open_context(context_handle), (x_TD, ids_TK, scores_TK, w13, w2), w13_layout, weights_transposed)
    return [torch.empty_like(x) for x in x_TD]


@torch.library.custom_op("poise::routed_experts_virtual_forward_clip_counts", mutates_args=())
def routed_experts_virtual_forward_clip_counts(
    x_TD: list[Tensor], ids_TK: list[Tensor], scores_TK: list[Tensor], w13: list[Tensor], w2: list[Tensor],
    context_handle: int, w13_layout: str, weights_transposed: bool,
) -> tuple[list[Tensor], list[Tensor]]:
    """routed_experts_virtual_forward that also returns every rank's SwiGLU clip counts."""
    context = open_context(context_handle)
    per_rank = check_rank_lists(context, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout, weights_transposed)
    return engine_of(context).forward_ranks(per_rank, w13_layout, clip_counts=True,
                                            weights_transposed=weights_transposed)


@routed_experts_virtual_forward_clip_counts.register_fake
def _(x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, weights_transposed):
    context = open_context(context_handle)
    check_rank_lists(context, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout, weights_transposed)
    return ([torch.empty_like(x) for x in x_TD],
            [x.new_empty(_clip_counts_shape(context), dtype=torch.int64) for x in x_TD])


@torch.library.custom_op("poise::routed_experts_virtual_backward", mutates_args=())
def routed_experts_virtual_backward(
    grad_out_TD: list[Tensor], x_TD: list[Tensor], ids_TK: list[Tensor], scores_TK: list[Tensor],
    w13: list[Tensor], w2: list[Tensor], context_handle: int, w13_layout: str, weights_transposed: bool,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    context, per_rank = _open_virtual_backward(context_handle, grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2),
                                               w13_layout, weights_transposed)
    return engine_of(context).backward_ranks(list(grad_out_TD), per_rank, w13_layout, None,
                                             weights_transposed=weights_transposed)


@routed_experts_virtual_backward.register_fake
def _(grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, context_handle, w13_layout, weights_transposed):
    _open_virtual_backward(context_handle, grad_out_TD, (x_TD, ids_TK, scores_TK, w13, w2), w13_layout,
                           weights_transposed)
    return ([torch.empty_like(x) for x in x_TD], [torch.empty_like(s) for s in scores_TK],
            [torch.empty_like(w) for w in w13], [torch.empty_like(w) for w in w2])


def _open_virtual_backward(context_handle, grad_out_TD, lists, w13_layout,
                           weights_transposed) -> tuple[Context, list[tuple]]:
    context = open_context(context_handle)
    check_training(context)
    per_rank = check_rank_lists(context, lists, w13_layout, weights_transposed)
    check_rank_grad_outs(context, grad_out_TD)
    return context, per_rank
