"""Random inputs of every rank for tests and benchmarks, and the global view of the experts."""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import Config
from ..errors import InvalidArgument

ROUTINGS = ("uniform", "one_expert", "first_rank")
INPUT_NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")


def _check_routing(routing: str, top_k: int, num_local_experts: int) -> None:
    if routing not in ROUTINGS:
        raise InvalidArgument("routing", f"must be one of {ROUTINGS}, got {routing!r}")
    if routing == "first_rank" and top_k > num_local_experts:
        raise InvalidArgument("routing", f"'first_rank' needs top_k <= E_local ({top_k} > {num_local_experts})")


def _weight_shapes(w13_shape: str, L: int, D: int, F: int) -> tuple[tuple, tuple]:
    """(w13 shape, w2 shape) of one rank's L local experts."""
    w13_shapes = {"E2FD": (L, 2 * F, D), "E2_F_D": (L, 2, F, D), "flat": (L * 2 * F, D)}
    if w13_shape not in w13_shapes:
        raise InvalidArgument("w13_shape", f"must be one of {sorted(w13_shapes)}, got {w13_shape!r}")
    return w13_shapes[w13_shape], (L * D, F) if w13_shape == "flat" else (L, D, F)


def _random_ids(routing: str, T: int, K: int, E: int, L: int, generator: torch.Generator) -> torch.Tensor:
    """int64 [T, K]: K distinct experts per token."""
    if routing == "first_rank":
        return torch.rand(T, L, generator=generator).argsort(dim=1)[:, :K]
    if routing == "one_expert":
        others = torch.rand(T, E - 1, generator=generator).argsort(dim=1)[:, : K - 1] + 1
        return torch.cat([torch.zeros(T, 1, dtype=torch.long), others], dim=1)
    return torch.rand(T, E, generator=generator).argsort(dim=1)[:, :K]


def random_inputs(
    config: Config,
    ep_size: int,
    *,
    seed: int = 0,
    scores_dtype: torch.dtype = torch.float32,
    routing: str = "uniform",
    padding_rows: int = 0,
    free_fraction: float = 0.0,
    w13_shape: str = "E2FD",
) -> dict[str, list[torch.Tensor]]:
    """Random inputs of every rank: {'x_TD', 'ids_TK', 'scores_TK', 'w13', 'w2'} -> per-rank lists.

    x ~ N(0, 1), W13 ~ N(0, 1/D), W2 ~ N(0, 1/F) in bf16; scores a softmax over the K picks;
    K distinct experts per token. routing: 'uniform'; 'one_expert' (every token picks expert 0,
    its other picks uniform); 'first_rank' (every pick among rank 0's experts: needs K <= E_local).
    The last ``padding_rows`` tokens of every rank get zero scores. Each (t, k) is free (id -1, no
    expert; its score kept) with probability ``free_fraction``. w13_shape: 'E2FD' [E_local, 2F,
    D], 'E2_F_D' [E_local, 2, F, D] or 'flat' [E_local*2F, D] (w2 then [E_local*D, F]).
    """
    T, D, F = config.num_local_input_tokens, config.hidden_dim, config.intermediate_dim
    K, E = config.top_k, config.num_experts
    L = E // ep_size
    _check_routing(routing, K, L)
    generator = torch.Generator().manual_seed(seed)
    w13_dims, w2_dims = _weight_shapes(w13_shape, L, D, F)

    def normal(*shape, std=1.0):
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in INPUT_NAMES}
    for _ in range(ep_size):  # the order of the draws fixes what a seed gives: keep it
        ids = _random_ids(routing, T, K, E, L, generator)
        scores = torch.randn(T, K, generator=generator).softmax(dim=1)
        if padding_rows:
            scores[T - padding_rows:] = 0
        inputs["x_TD"].append(normal(T, D))
        inputs["ids_TK"].append(ids.to(torch.int32))
        inputs["scores_TK"].append(scores.to(scores_dtype))
        inputs["w13"].append(normal(*w13_dims, std=D**-0.5))
        inputs["w2"].append(normal(*w2_dims, std=F**-0.5))
        if free_fraction:  # drawn last, so the other draws of a seed stay what they were
            inputs["ids_TK"][-1][torch.rand(T, K, generator=generator) < free_fraction] = -1
    return inputs


def global_experts(w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], config: Config) -> tuple:
    """Every rank's local experts, in rank order: (w13_E2FD [E, 2F, D], w2_EDF [E, D, F])."""
    D, F = config.hidden_dim, config.intermediate_dim
    return (torch.cat([w.reshape(-1, 2 * F, D) for w in w13]), torch.cat([w.reshape(-1, D, F) for w in w2]))
