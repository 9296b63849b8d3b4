"""The user entry points: poise.routed_experts (one rank) and poise.routed_experts_virtual (every
rank of a virtual-ranks context). Each checks what only the caller knows (grad mode, the Python
types the op schema would reject less helpfully), then calls the op, or in plain eager mode the
op's implementation directly (autograd.EagerForward)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..context import Context
from ..errors import InvalidArgument, NotAvailable
from ..options import ExecutionOptions
from . import autograd
from .checks import (INPUT_NAMES, PREPARED_FIELDS, PREPARED_T_FIELDS, check_prepared, check_rank_lists,
                     check_weights_transposed)
from .fp8_weights import FORMATS, PreparedWeights


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
    weights_transposed: bool = False,
    b13: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    prepared: Optional[PreparedWeights] = None,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """The routed experts of one MoE layer on this rank: out_TD[t] = sum_k scores_TK[t,k] * expert(x_TD[t]).

    x_TD bf16 [T, D]; ids_TK int32 [T, K] global expert ids (distinct per token), or -1 for no expert
    (the entry is not computed, adds nothing whatever its score, and gets zero gradients: padding
    rows with ids -1 cost nothing); scores_TK bf16 or
    fp32 [T, K]; w13 bf16 [E_local, 2, F, D] / [E_local, 2F, D] / [E_local*2F, D] (gate rows then up
    rows per expert, or interleaved with w13_layout='gate_up_interleaved'); w2 bf16 [E_local, D, F]
    / [E_local*D, F]. ``weights_transposed=True``: the weights as stored for x @ W (transformers'
    gpt-oss), w13 [E_local, D, 2F] (columns in w13_layout's order) and w2 [E_local, F, D], read as
    stored (no copy on the GPU); their grads come in the same layout.
    Returns out_TD bf16 [T, D]. Differentiable in x_TD, scores_TK, w13 and w2.
    Collective over the context's EP group. Raises poise.InvalidArgument naming the argument.
    With ``options.clip_statistics`` returns (out_TD, clip_counts): int64 [E_local, 2] on out's
    device, for each local expert the gate inputs above ``swiglu_limit`` and the up inputs outside
    [-limit, limit] over all its rows on every rank (counted on h13 as saved, bf16, biases
    included; zeros for plain SwiGLU).
    Expert biases (gpt-oss), both or neither: b13 bf16 [E_local, 2F] in W13's row order, added
    before the activation, and b2 bf16 [E_local, D], added before the score; differentiable too
    (with ``accumulate_wgrad`` their grads are added into their own .main_grad / .grad).
    ``prepared``: w13 and w2 as poise.prepare_weights quantized them (a poise.PreparedWeights on the
    context's device, for these w13 / w2: refill it with ``out=`` after each weight update), which
    a gemm_precision='fp8_block_scaled' GPU context's forward reads instead of quantizing w13 and w2
    on every call (the same bits when they are current; w13 and w2 are still required: replica slots
    and a backward read them). Not on BF16 contexts (InvalidArgument naming ``prepared``), not on CPU
    contexts yet (NotAvailable naming ``prepared``: the reference engine quantizes w13 and w2
    itself), not with expert biases or transposed weights (not built in FP8); the prepared tensors
    get no grads. Prepared with ``transposed=True``, its transposed copies are kept for the backward,
    whose DGRAD reads them instead of quantizing w13 and w2 transposed (the same bits).
    """
    options = ExecutionOptions() if options is None else options
    if (b13 is None) != (b2 is None):  # the op checks the rest (check_biases)
        raise InvalidArgument("b13" if b13 is None else "b2", "expert biases go together: pass b13 and b2")
    tensors = (x_TD, ids_TK, scores_TK, w13, w2) + (() if b13 is None else (b13, b2))
    fp8 = None if prepared is None else _prepared_tensors(prepared)  # the op checks the rest (check_prepared)
    fp8_t = None if prepared is None else _prepared_tensors(prepared, transposed=True)  # None: not prepared
    if torch.compiler.is_compiling():
        # Dynamo cannot trace into the C++ objects: the op's fake implementation checks instead.
        _refuse_compiled_accumulation(options)
    else:
        _check_before_the_op(tensors, context, options, weights_transposed, fp8)
        if fp8 is None and context._cpp.config.prepared_fp8_weights:  # not .config: a Python copy per call
            raise InvalidArgument("prepared", "this context's Config has prepared_fp8_weights=True: every call "
                                              "passes poise.prepare_weights' tensors (the plan holds no scratch to "
                                              "quantize w13 and w2 into)")
        if autograd.plain_eager(tensors + (fp8 or ()) + (fp8_t or ())):
            call = autograd.EagerCall(context.handle, w13_layout, options.accumulate_wgrad, weights_transposed,
                                      options.clip_statistics, options.sync_check or context.sync_check, fp8, fp8_t)
            if not _wants_grad(tensors[:1] + tensors[2:]):  # nothing to differentiate: no autograd node
                return _sync_checked(autograd.eager_forward_on_engine(call, tensors), context, options)
            return _sync_checked(autograd.EagerForward.apply(call, *tensors), context, options)
    if fp8 is not None and b13 is not None:
        raise _biases_with_prepared()
    op = getattr(torch.ops.poise, _FORWARD_OPS[(b13 is not None, fp8 is not None, options.clip_statistics)])
    result = op(*tensors, *(fp8 or ()), context.handle, w13_layout, weights_transposed, options.accumulate_wgrad,
                *(fp8_t or ()))
    return result if torch.compiler.is_compiling() else _sync_checked(result, context, options)


_FORWARD_OPS = {  # (biased, prepared, clip_statistics): the forward op
    (False, False, False): "routed_experts_forward", (False, False, True): "routed_experts_forward_clip_counts",
    (True, False, False): "routed_experts_biased_forward",
    (True, False, True): "routed_experts_biased_forward_clip_counts",
    (False, True, False): "routed_experts_prepared_forward",
    (False, True, True): "routed_experts_prepared_forward_clip_counts",
}


def _prepared_tensors(prepared, transposed: bool = False) -> Optional[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """A PreparedWeights' tensors in the ops' order (checks.PREPARED_FIELDS), or with ``transposed``
    its transposed copies (checks.PREPARED_T_FIELDS; None when it holds none)."""
    if not isinstance(prepared, PreparedWeights):
        raise InvalidArgument("prepared", f"must be a poise.PreparedWeights (from poise.prepare_weights) or None, "
                                          f"got {type(prepared).__name__}")
    if prepared.format not in FORMATS:
        raise InvalidArgument("prepared", f"holds format {prepared.format!r}, not one of {', '.join(FORMATS)}")
    fields = PREPARED_T_FIELDS if transposed else PREPARED_FIELDS
    tensors = tuple(getattr(prepared, field) for field in fields)
    if transposed and all(t is None for t in tensors):
        return None
    for field, value in zip(fields, tensors):
        if not isinstance(value, Tensor):  # the op's schema would reject it less helpfully
            raise InvalidArgument(f"prepared.{field}", f"must be a torch.Tensor, got {type(value).__name__}")
    return tensors


def _biases_with_prepared() -> NotAvailable:
    return NotAvailable("b13: expert biases are not built for gemm_precision fp8_block_scaled yet, so neither "
                        "with prepared FP8 weights")


def _sync_checked(result, context: Context, options: ExecutionOptions):
    """ExecutionOptions.sync_check: the call's device faults raise here (not while capturing a graph)."""
    wanted = options.sync_check or context.sync_check
    if wanted and not (context.device != "cpu" and torch.cuda.is_current_stream_capturing()):
        context.check()
    return result


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
    weights_transposed: bool = False,
) -> Union[list[Tensor], tuple[list[Tensor], list[Tensor]]]:
    """poise.routed_experts for every rank of a virtual-ranks context: each argument is a list of
    one tensor per rank (rank order, shapes and dtypes of poise.routed_experts); returns each rank's
    out_TD. Differentiable in every rank's x_TD, scores_TK, w13 and w2 (one backward call runs all
    ranks, as the ranks' backwards are collective). Raises poise.InvalidArgument naming the argument
    (with 'rank r: ' for a per-rank tensor). With ``options.clip_statistics`` returns (outs,
    clip_counts): one int64 [E_local, 2] per rank, as poise.routed_experts documents;
    ``weights_transposed`` as there, for every rank (no expert biases here yet)."""
    options = ExecutionOptions() if options is None else options
    _check_options(options)
    if options.accumulate_wgrad:
        raise NotAvailable("accumulate_wgrad with virtual ranks: not wired to Python in this build (use "
                           "poise.routed_experts on a one-rank context, or poise.reference.Engine's accumulate_into)")
    _check_context(context)
    lists = [list(v) if isinstance(v, (list, tuple)) else v for v in (x_TD, ids_TK, scores_TK, w13, w2)]
    if not torch.compiler.is_compiling():
        # Before the op: its schema would reject less helpfully.
        check_rank_lists(context, lists, w13_layout, weights_transposed)
        differentiable = [t for name, tensors in zip(INPUT_NAMES, lists) if name != "ids_TK" for t in tensors]
        _refuse_grad_on_inference(context, differentiable)
    op = (torch.ops.poise.routed_experts_virtual_forward_clip_counts if options.clip_statistics
          else torch.ops.poise.routed_experts_virtual_forward)
    result = op(*lists, context.handle, w13_layout, weights_transposed)
    return result if torch.compiler.is_compiling() else _sync_checked(result, context, options)


# ---- checks before the op ------------------------------------------------------------------------


def _check_before_the_op(tensors, context, options, weights_transposed, prepared=None) -> None:
    """What the op's schema would reject less helpfully, and what only the caller knows (grad mode).
    ``prepared``: the prepared FP8 weights' tensors, or None."""
    _check_context(context)
    _check_options(options)
    check_weights_transposed(weights_transposed)
    named = dict(zip(("x_TD", "ids_TK", "scores_TK", "w13", "w2", "b13", "b2"), tensors))
    for name, value in named.items():
        if not isinstance(value, Tensor):
            raise InvalidArgument(name, f"must be a torch.Tensor, got {type(value).__name__}")
    if prepared is not None and "b13" in named:  # no op takes both: refused here (the op checks prepared)
        check_prepared(context, weights_transposed, prepared)
        raise _biases_with_prepared()
    differentiable = [t for name, t in named.items() if name != "ids_TK"]
    _refuse_grad_on_inference(context, differentiable)
    if options.accumulate_wgrad and _wants_grad(differentiable):
        for name in ("w13", "w2", "b13", "b2")[:len(tensors) - 3]:
            parameter = named[name]
            if parameter.requires_grad and not parameter.is_leaf:
                raise InvalidArgument(name, "accumulate_wgrad adds into the parameter's .main_grad/.grad, so pass "
                                            "the parameter itself (a leaf tensor), not a view or a result")


def _check_context(context) -> None:
    if not isinstance(context, Context):
        raise InvalidArgument("context", f"must be a poise.Context, got {type(context).__name__}")
    context._require_open()


def _check_options(options) -> None:
    if not isinstance(options, ExecutionOptions):
        raise InvalidArgument("options", f"must be a poise.ExecutionOptions or None, got {type(options).__name__}")
    options.validate()


def _wants_grad(differentiable_inputs) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in differentiable_inputs)


def _refuse_grad_on_inference(context: Context, differentiable_inputs) -> None:
    if _wants_grad(differentiable_inputs) and context._cpp.config.inference:
        raise InvalidArgument("context", "was created with inference=true: run under torch.no_grad() or "
                                         "create a training context")


def _refuse_compiled_accumulation(options: ExecutionOptions) -> None:
    # AOTAutograd traces backward on functional tensors, not the parameters whose buffers
    # accumulate_wgrad must find.
    if options.accumulate_wgrad:
        raise NotAvailable("accumulate_wgrad under torch.compile: the weight-gradient buffers are found on the "
                           "parameters at backward time, which a compiled backward does not see; run it eagerly")
