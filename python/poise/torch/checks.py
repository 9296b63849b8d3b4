"""Host-side checks of a routed_experts call, before anything runs.

Every mistake a host can see (type, device, dtype, shape, T differing from the Config, contiguity,
a closed context, a call of the wrong kind for its context) raises poise.InvalidArgument naming the
argument. The real and the fake (meta) implementations of the ops run the same checks, so
FakeTensor tracing reports them too; poise.reference.Engine checks its tensors with them as well.
Expert ids out of range (other than -1, no expert) are data: the CPU reference checks them on the host, the GPU reports them
through its device error word.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

import torch

from ..context import Context, context_from_handle
from ..errors import InvalidArgument, NotAvailable
from .fp8_weights import scales_shape

SCORES_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
WGRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The weights are bf16 (check_inputs), so are the weight grads the non-accumulating ops return:
# autograd would cast any other dtype to the weights' anyway.
WEIGHT_GRAD_DTYPE_NAME = "bf16"
W13_LAYOUTS = ("gate_up_blocked", "gate_up_interleaved")
INPUT_NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")
_BF16 = (torch.bfloat16,)
_INT32 = (torch.int32,)


# ---- tensors -------------------------------------------------------------------------------------


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def device_matches(device: torch.device, context_device: str) -> bool:
    """'cpu' and 'cuda' match any device of that type; 'cuda:N' only device N."""
    kind, _, index = context_device.partition(":")
    return device.type == kind and (not index or device.index == int(index))


def check_tensor(
    name: str,
    value: Any,
    *,
    device: str,
    dtypes: Collection[torch.dtype],
    shapes: Sequence[tuple[int, ...]],
    shape_rule: Callable[[], str],
    prefix: str = "",
) -> None:
    """One tensor argument: type, device, dtype, shape (one of ``shapes``, tuples), contiguity.
    ``shape_rule`` writes the expected shape for the message: it runs only for a refused call (this
    check is on every eager call's host path)."""
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(name, f"{prefix}must be a torch.Tensor, got {type(value).__name__}")
    if not device_matches(value.device, device):
        raise InvalidArgument(name, f"{prefix}must be on the context's device {device}, got {value.device}")
    if value.dtype not in dtypes:
        wanted = " or ".join(str(d) for d in dtypes)
        hint = f": convert with {name}.to(torch.int32)" if value.dtype == torch.int64 and torch.int32 in dtypes else ""
        raise InvalidArgument(name, f"{prefix}must be {wanted}, got {value.dtype}{hint}")
    if tuple(value.shape) not in shapes:
        raise InvalidArgument(name, f"{prefix}must have shape {shape_rule()}, got {_shape(value)}")
    if not value.is_contiguous():
        raise InvalidArgument(name, f"{prefix}must be contiguous (call .contiguous()), got strides {value.stride()}")


def check_rows(name: str, value: torch.Tensor, config: Any, prefix: str = "") -> None:
    """A clearer message for the most common shape mistake: a T that is not the Config's."""
    T = config.num_local_input_tokens
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] != T:
        raise InvalidArgument(
            name,
            f"{prefix}has {value.shape[0]} rows but the Config's num_local_input_tokens is {T} "
            "(every call has exactly T rows: pad with rows whose ids are -1, which cost nothing)",
        )


def check_inputs(
    config: Any, ep_size: int, device: str, x_TD: Any, ids_TK: Any, scores_TK: Any, w13: Any, w2: Any, prefix: str = "",
    weights_transposed: bool = False,
) -> None:
    """The five inputs of one rank. ``config`` is a poise.Config or the C++ Config (same fields).
    ``weights_transposed``: w13 [E_local, D, 2F] and w2 [E_local, F, D] (x @ W, gpt-oss)."""
    T, D = config.num_local_input_tokens, config.hidden_dim
    K = config.top_k
    for name, value in (("x_TD", x_TD), ("ids_TK", ids_TK), ("scores_TK", scores_TK)):
        check_rows(name, value, config, prefix)
    check_tensor("x_TD", x_TD, device=device, dtypes=_BF16, shapes=[(T, D)],
                 shape_rule=lambda: f"[T={T}, D={D}]", prefix=prefix)
    check_tensor("ids_TK", ids_TK, device=device, dtypes=_INT32, shapes=[(T, K)],
                 shape_rule=lambda: f"[T={T}, K={K}]", prefix=prefix)
    check_tensor("scores_TK", scores_TK, device=device, dtypes=SCORES_DTYPES, shapes=[(T, K)],
                 shape_rule=lambda: f"[T={T}, K={K}]", prefix=prefix)
    check_weights(config, ep_size, device, w13, w2, weights_transposed, prefix)


def check_weights(config: Any, ep_size: int, device: str, w13: Any, w2: Any, weights_transposed: bool,
                  prefix: str = "") -> None:
    """w13 and w2 of one rank, in the memory orders the engines take."""
    D, F, L = config.hidden_dim, config.intermediate_dim, config.num_experts // ep_size
    dims = f"E_local={L}, D={D}, F={F}"
    if weights_transposed:  # as stored for x @ W: only the 3-D forms, which transformers keeps
        w13_shapes, w13_rule = [(L, D, 2 * F)], f"[E_local, D, 2F] (weights_transposed=True) with {dims}"
        w2_shapes, w2_rule = [(L, F, D)], f"[E_local, F, D] (weights_transposed=True) with {dims}"
    else:
        w13_shapes = [(L, 2, F, D), (L, 2 * F, D), (L * 2 * F, D)]
        w13_rule = f"[E_local, 2, F, D], [E_local, 2F, D] or [E_local*2F, D] with {dims}"
        w2_shapes, w2_rule = [(L, D, F), (L * D, F)], f"[E_local, D, F] or [E_local*D, F] with {dims}"
    check_tensor("w13", w13, device=device, dtypes=_BF16, shapes=w13_shapes, shape_rule=lambda: w13_rule,
                 prefix=prefix)
    check_tensor("w2", w2, device=device, dtypes=_BF16, shapes=w2_shapes, shape_rule=lambda: w2_rule, prefix=prefix)


def check_weights_transposed(weights_transposed: Any) -> None:
    if not isinstance(weights_transposed, bool):
        raise InvalidArgument("weights_transposed", f"must be a bool, got {type(weights_transposed).__name__}")


def check_grad_out(config: Any, device: str, grad_out_TD: Any, prefix: str = "") -> None:
    T, D = config.num_local_input_tokens, config.hidden_dim
    check_tensor("grad_out_TD", grad_out_TD, device=device, dtypes=_BF16, shapes=[(T, D)],
                 shape_rule=lambda: f"[T={T}, D={D}]", prefix=prefix)


def check_w13_layout(w13_layout: Any) -> None:
    if w13_layout not in W13_LAYOUTS:
        raise InvalidArgument("w13_layout", f"must be one of {W13_LAYOUTS}, got {w13_layout!r}")


def wgrad_dtype(config: Any) -> torch.dtype:
    """The dtype weight grads are accumulated in (Config.wgrad_dtype): the accumulating ops' buffers."""
    return WGRAD_DTYPES[config.wgrad_dtype]


def check_accumulation_buffer(name: str, target: Any, weight: torch.Tensor, config: Any, prefix: str = "") -> None:
    """An accumulation buffer: a contiguous tensor of the weight's shape and device, in wgrad_dtype."""
    dtype = wgrad_dtype(config)
    if not isinstance(target, torch.Tensor):
        raise InvalidArgument(name, f"{prefix}must be a torch.Tensor, got {type(target).__name__}")
    if target.shape != weight.shape or target.device != weight.device:
        raise InvalidArgument(name, f"{prefix}must have the weight's shape {list(weight.shape)} and device "
                                    f"{weight.device}, got {list(target.shape)} on {target.device}")
    if target.dtype != dtype:
        raise InvalidArgument(name, f"{prefix}must be {dtype} (Config.wgrad_dtype={config.wgrad_dtype}), "
                                    f"got {target.dtype}")
    if not target.is_contiguous():
        raise InvalidArgument(name, f"{prefix}must be contiguous")


def check_same_scores_dtype(scores_TK: Sequence[torch.Tensor]) -> None:
    """Every rank's scores in one dtype: the engines are built for one."""
    dtypes = {s.dtype for s in scores_TK}
    if len(dtypes) != 1:
        raise InvalidArgument("scores_TK", f"every rank must use the same dtype, got {sorted(map(str, dtypes))}")


# ---- one call against its context ----------------------------------------------------------------


def open_context(handle: int) -> Context:
    """The live, open Context an op's ``context_handle`` names."""
    context = context_from_handle(handle)
    context._require_open()
    return context


def check_training(context: Context) -> None:
    if context._cpp.config.inference:
        raise InvalidArgument("context", "was created with inference=true; backward needs a training context")


def check_one_rank_call(context: Context, x_TD, ids_TK, scores_TK, w13, w2, w13_layout, weights_transposed) -> None:
    """The tensors of one rank's call on a one-rank context."""
    if context.virtual_ranks:
        raise InvalidArgument("context", "is a virtual-ranks context (all ranks in this process): call "
                                         "poise.routed_experts_virtual with one tensor per rank")
    check_w13_layout(w13_layout)
    check_weights_transposed(weights_transposed)
    check_inputs(context._cpp.config, context.ep_size, context.device, x_TD, ids_TK, scores_TK, w13, w2,
                 weights_transposed=weights_transposed)


def check_biases(config: Any, ep_size: int, device: str, b13: Any, b2: Any, prefix: str = "") -> None:
    """One rank's expert biases (gpt-oss), given together: b13 bf16 [E_local, 2F] in W13's row order
    and b2 bf16 [E_local, D], on ``device``, contiguous. ``config`` as for check_inputs."""
    if (b13 is None) != (b2 is None):
        raise InvalidArgument("b13" if b13 is None else "b2", f"{prefix}expert biases go together: pass b13 and b2")
    local = config.num_experts // ep_size
    for name, value, shape in (("b13", b13, (local, 2 * config.intermediate_dim)), ("b2", b2, (local, config.hidden_dim))):
        check_tensor(name, value, device=device, dtypes=_BF16, shapes=[shape],
                     shape_rule=lambda shape=shape: "[" + ", ".join(map(str, shape)) + "]", prefix=prefix)


PREPARED_FIELDS = ("w13", "w13_scales", "w2", "w2_scales")  # PreparedWeights' tensors, in the ops' order
# The backward's transposed copies (poise.prepare_weights(..., transposed=True)), in the ops' order.
PREPARED_T_FIELDS = ("w13_t", "w13_t_scales", "w2_t", "w2_t_scales")


def check_prepared(context: Context, weights_transposed: bool, prepared: Sequence[Any],
                   transposed: bool = False) -> None:
    """Prepared FP8 weights of a one-rank call (poise.prepare_weights' tensors, PREPARED_FIELDS'
    order, or with ``transposed`` the backward's copies, PREPARED_T_FIELDS'): check_prepared_arguments,
    then a CPU context refuses them (NotAvailable: the reference engine quantizes w13 / w2 itself)."""
    check_prepared_arguments(context, weights_transposed, prepared, transposed)
    if context.device == "cpu":
        raise NotAvailable("prepared: the CPU reference engine does not take prepared FP8 weights yet (it quantizes "
                           "w13 and w2 itself, bit for bit as poise.prepare_weights does): call without prepared")


def check_prepared_arguments(context: Context, weights_transposed: bool, prepared: Sequence[Any],
                             transposed: bool = False) -> None:
    """Only on a gemm_precision='fp8_block_scaled' context (else InvalidArgument naming ``prepared``),
    not with transposed weights (NotAvailable); each tensor on the context's device, contiguous, e4m3
    values in w13's / w2's shape ([E_local, 2F, D] or [E_local, 2, F, D] / [E_local, D, F]) and fp32
    scales [E_local, ceil(rows/128), ceil(cols/128)], or with ``transposed`` each matrix transposed
    ([E_local, D, 2F] / [E_local, F, D]) (InvalidArgument naming ``prepared.<field>``)."""
    config = context._cpp.config
    if config.gemm_precision != "fp8_block_scaled":
        raise InvalidArgument("prepared", "prepared FP8 weights are read only with gemm_precision="
                                          f"'fp8_block_scaled'; this context's Config has '{config.gemm_precision}'")
    if weights_transposed:
        raise NotAvailable("weights_transposed: transposed weights are not built for gemm_precision fp8_block_scaled "
                           "(nor with prepared weights) yet")
    L, D, F = config.num_experts // context.ep_size, config.hidden_dim, config.intermediate_dim
    dims = f"E_local={L}, D={D}, F={F}"
    w13_blocks, w2_blocks = scales_shape((L, 2 * F, D)), scales_shape((L, D, F))
    w13_t_blocks, w2_t_blocks = scales_shape((L, D, 2 * F)), scales_shape((L, F, D))
    expected = {  # field: (dtype, shapes, the rule for the message)
        "w13": (torch.float8_e4m3fn, [(L, 2 * F, D), (L, 2, F, D)],
                f"[E_local, 2F, D] or [E_local, 2, F, D] with {dims}"),
        "w13_scales": (torch.float32, [w13_blocks], f"[E_local, ceil(2F/128), ceil(D/128)] = {list(w13_blocks)}"),
        "w2": (torch.float8_e4m3fn, [(L, D, F)], f"[E_local, D, F] with {dims}"),
        "w2_scales": (torch.float32, [w2_blocks], f"[E_local, ceil(D/128), ceil(F/128)] = {list(w2_blocks)}"),
        "w13_t": (torch.float8_e4m3fn, [(L, D, 2 * F)], f"[E_local, D, 2F] with {dims}"),
        "w13_t_scales": (torch.float32, [w13_t_blocks],
                         f"[E_local, ceil(D/128), ceil(2F/128)] = {list(w13_t_blocks)}"),
        "w2_t": (torch.float8_e4m3fn, [(L, F, D)], f"[E_local, F, D] with {dims}"),
        "w2_t_scales": (torch.float32, [w2_t_blocks], f"[E_local, ceil(F/128), ceil(D/128)] = {list(w2_t_blocks)}"),
    }
    fields = PREPARED_T_FIELDS if transposed else PREPARED_FIELDS
    if len(prepared) != len(fields):
        raise InvalidArgument("prepared", f"needs the {len(fields)} tensors {fields}, got {len(prepared)}")
    for field, value in zip(fields, prepared):
        dtype, shapes, rule = expected[field]
        check_tensor(f"prepared.{field}", value, device=context.device, dtypes=(dtype,), shapes=shapes,
                     shape_rule=lambda rule=rule: rule)


ACCUMULATION_NAMES = ("grad_w13_acc", "grad_w2_acc", "grad_b13_acc", "grad_b2_acc")


def check_accumulation(context: Context, parameters: Sequence[torch.Tensor], buffers: Sequence[Any]) -> None:
    """The buffers a one-rank backward adds the grads of ``parameters`` (w13, w2[, b13, b2]) into."""
    if len(buffers) != len(parameters):
        raise InvalidArgument("accumulate", f"needs one buffer per weight and bias ({len(parameters)}), "
                                            f"got {len(buffers)}")
    for name, buffer, parameter in zip(ACCUMULATION_NAMES, buffers, parameters):
        check_accumulation_buffer(name, buffer, parameter, context._cpp.config)


def _check_one_list_per_input(lists: Sequence[Any], ranks: int) -> None:
    for name, values in zip(INPUT_NAMES, lists):
        if not isinstance(values, (list, tuple)) or len(values) != ranks:
            got = f"{len(values)} items" if isinstance(values, (list, tuple)) else type(values).__name__
            raise InvalidArgument(name, f"must be a list of one tensor per rank ({ranks}), got {got}")


def check_rank_lists(context: Context, lists: Sequence[Any], w13_layout: str, weights_transposed: bool) -> list[tuple]:
    """The per-rank lists of a virtual-ranks call (x_TD, ids_TK, scores_TK, w13, w2 in that order);
    returns one (x_TD, ids_TK, scores_TK, w13, w2) tuple per rank."""
    if not context.virtual_ranks:
        raise InvalidArgument("context", "drives one rank: create it with virtual_ranks=True for "
                                         "poise.routed_experts_virtual, or call poise.routed_experts")
    check_w13_layout(w13_layout)
    check_weights_transposed(weights_transposed)
    _check_one_list_per_input(lists, context.ep_size)
    per_rank = list(zip(*lists))
    for r, inputs in enumerate(per_rank):
        check_inputs(context._cpp.config, context.ep_size, context.device, *inputs, prefix=f"rank {r}: ",
                     weights_transposed=weights_transposed)
    check_same_scores_dtype([inputs[2] for inputs in per_rank])
    devices = {inputs[0].device for inputs in per_rank}
    if len(devices) != 1:  # a 'cpu' context matches any CPU tensor; virtual GPU ranks share one device
        raise InvalidArgument("x_TD", f"every rank's tensors must be on one device, got {sorted(map(str, devices))}")
    return per_rank


def check_rank_grad_outs(context: Context, grad_out_TD: Any) -> None:
    """grad_out_TD of a virtual-ranks backward: one tensor per rank."""
    if not isinstance(grad_out_TD, (list, tuple)) or len(grad_out_TD) != context.ep_size:
        raise InvalidArgument("grad_out_TD", f"must be a list of one tensor per rank ({context.ep_size})")
    for r, grad in enumerate(grad_out_TD):
        check_grad_out(context._cpp.config, context.device, grad, prefix=f"rank {r}: ")
