"""The oracles the engines are tested against, written independently of the engines.

- ``dense_float64``: the C++ float64 oracle (dense loops over every token and pick, no ranks, no
  rounding).
- ``routed_experts_torch``: the same layer in plain PyTorch ops, differentiable, in the tensors'
  dtype: tests compare both engines' grads with its autograd in float64.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as functional

from .. import _poise
from ..config import Config, to_cpp
from ..errors import InvalidArgument, as_index
from ..torch.checks import SCORES_DTYPES, check_w13_layout
from .arrays import float32_array, input_arrays


def dense_float64(
    config: Config,
    ep_size: int,
    x_TD: Sequence[torch.Tensor],
    ids_TK: Sequence[torch.Tensor],
    scores_TK: Sequence[torch.Tensor],
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    *,
    grad_out_TD: Optional[Sequence[torch.Tensor]] = None,
    w13_layout: str = "gate_up_blocked",
    b13: Optional[Sequence[torch.Tensor]] = None,
    b2: Optional[Sequence[torch.Tensor]] = None,
) -> dict[str, list[torch.Tensor]]:
    """The C++ float64 oracle. Returns {'out_TD': [...]} and, with grad_out_TD, 'grad_x_TD',
    'grad_scores_TK', 'grad_w13' [E_local, 2F, D] and 'grad_w2' [E_local, D, F] (and with expert
    biases b13 [E_local, 2F] / b2 [E_local, D], 'grad_b13' and 'grad_b2'): float64 per rank."""
    cpp = to_cpp(config)
    ep_size = as_index("ep_size", ep_size)
    check_w13_layout(w13_layout)
    scores_dtype = SCORES_DTYPES.get(scores_TK[0].dtype) if len(scores_TK) else None
    if scores_dtype is None:
        raise InvalidArgument("scores_TK", "must be a non-empty list of bf16 or fp32 tensors")
    grads = [] if grad_out_TD is None else [float32_array(g) for g in grad_out_TD]
    *inputs, b13_arrays, b2_arrays = input_arrays(x_TD, ids_TK, scores_TK, w13, w2, b13, b2)
    result = _poise.reference_dense_float64(cpp, ep_size, scores_dtype, w13_layout, *inputs, grads, b13_arrays,
                                            b2_arrays)
    return {name: [torch.from_numpy(a) for a in arrays] for name, arrays in result.items()}


def swiglu_torch(h_gate: torch.Tensor, h_up: torch.Tensor, config: Config) -> torch.Tensor:
    """The activation in torch ops: silu(g) * u, or gpt-oss's clamped form.

    The clamped form's derivative jumps at +-limit; which side an element is on is decided on h as
    the engines save it for backward, bf16 (docs/reference_engine.md), the value itself is exact.
    """
    if config.activation == "swiglu":
        return functional.silu(h_gate) * h_up
    limit, alpha = config.swiglu_limit, config.swiglu_alpha

    def clamp(h: torch.Tensor, passes: torch.Tensor, low: float) -> torch.Tensor:
        value = h.detach().clamp(min=low, max=limit)
        return value + (h - h.detach()) * passes  # exact clamp, gradient where `passes`

    saved_gate, saved_up = h_gate.detach().float().bfloat16(), h_up.detach().float().bfloat16()
    g = clamp(h_gate, saved_gate <= limit, -float("inf"))
    u = clamp(h_up, (saved_up >= -limit) & (saved_up <= limit), -limit)
    return g * torch.sigmoid(alpha * g) * (u + 1)


def routed_experts_torch(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    scores_TK: torch.Tensor,
    w13_E2FD: torch.Tensor,
    w2_EDF: torch.Tensor,
    config: Config,
    *,
    w13_layout: str = "gate_up_blocked",
    b13_E2F: Optional[torch.Tensor] = None,
    b2_ED: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The layer in plain PyTorch: out[t] = sum_k scores[t,k] * (W2_e act(W13_e x[t] + b13_e) + b2_e),
    e = ids[t,k] (the biases, gpt-oss's, optional).

    Takes the global experts (w13_E2FD [E, 2F, D], w2_EDF [E, D, F]: every rank's local experts in
    rank order, see poise.reference.global_experts) and computes in the tensors' dtype (float64 for
    an oracle). Differentiable.
    """
    F = w13_E2FD.shape[1] // 2
    out_TD = torch.zeros_like(x_TD)
    ids = ids_TK.long()
    for e in range(w13_E2FD.shape[0]):
        tokens, picks = torch.nonzero(ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = x_TD[tokens] @ w13_E2FD[e].T
        if b13_E2F is not None:
            h = h + b13_E2F[e]
        if w13_layout == "gate_up_blocked":
            h_gate, h_up = h[:, :F], h[:, F:]
        else:
            h_gate, h_up = h[:, 0::2], h[:, 1::2]
        y = swiglu_torch(h_gate, h_up, config) @ w2_EDF[e].T
        if b2_ED is not None:
            y = y + b2_ED[e]
        out_TD = out_TD.index_add(0, tokens, scores_TK[tokens, picks].unsqueeze(1) * y)
    return out_TD
