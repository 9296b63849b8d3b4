"""Host-side checks of the tensors of a routed_experts call, before anything runs.

Every mistake a host can see (type, device, dtype, shape, T differing from the Config, contiguity)
raises poise.InvalidArgument naming the argument. The same checks run in the real and the fake
(meta) implementations of the ops, so FakeTensor tracing reports them too. Expert ids out of range
are data: the CPU reference checks them on the host, the GPU reports them through its device error
word.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

import torch

from .errors import InvalidArgument

SCORES_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
WGRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The weights are bf16 (check_inputs), so are the weight grads the non-accumulating ops return:
# autograd would cast any other dtype to the weights' anyway.
WEIGHT_GRAD_DTYPE_NAME = "bf16"
W13_LAYOUTS = ("gate_up_blocked", "gate_up_interleaved")
_BF16 = (torch.bfloat16,)
_INT32 = (torch.int32,)


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
            "(every call has exactly T rows: pad with rows whose scores are zero)",
        )


def check_inputs(
    config: Any, ep_size: int, device: str, x_TD: Any, ids_TK: Any, scores_TK: Any, w13: Any, w2: Any, prefix: str = ""
) -> None:
    """The five inputs of one rank. ``config`` is a poise.Config or the C++ Config (same fields)."""
    T, D, F = config.num_local_input_tokens, config.hidden_dim, config.intermediate_dim
    K, L = config.top_k, config.num_experts // ep_size
    for name, value in (("x_TD", x_TD), ("ids_TK", ids_TK), ("scores_TK", scores_TK)):
        check_rows(name, value, config, prefix)
    check_tensor("x_TD", x_TD, device=device, dtypes=_BF16, shapes=[(T, D)],
                 shape_rule=lambda: f"[T={T}, D={D}]", prefix=prefix)
    check_tensor("ids_TK", ids_TK, device=device, dtypes=_INT32, shapes=[(T, K)],
                 shape_rule=lambda: f"[T={T}, K={K}]", prefix=prefix)
    check_tensor("scores_TK", scores_TK, device=device, dtypes=SCORES_DTYPES, shapes=[(T, K)],
                 shape_rule=lambda: f"[T={T}, K={K}]", prefix=prefix)
    check_tensor("w13", w13, device=device, dtypes=_BF16,
                 shapes=[(L, 2, F, D), (L, 2 * F, D), (L * 2 * F, D)],
                 shape_rule=lambda: (f"[E_local, 2, F, D], [E_local, 2F, D] or [E_local*2F, D] with E_local={L}, "
                                     f"F={F}, D={D}"),
                 prefix=prefix)
    check_tensor("w2", w2, device=device, dtypes=_BF16, shapes=[(L, D, F), (L * D, F)],
                 shape_rule=lambda: f"[E_local, D, F] or [E_local*D, F] with E_local={L}, D={D}, F={F}", prefix=prefix)


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
