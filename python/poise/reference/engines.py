"""poise.reference.Engine: one MoE layer across ``ep_size`` virtual ranks on the CPU.

The C++ reference engine (poise::reference::Engine, threads as ranks) from PyTorch: ``forward`` and
``backward`` take one tensor per rank for each argument. Tests compare the GPU engine with it, and a
CPU virtual-ranks context runs on it (poise.torch.cpu_engines).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .. import _poise
from ..config import Config, to_cpp
from ..errors import InvalidArgument, as_index
from ..torch.checks import (SCORES_DTYPES, check_accumulation_buffer, check_biases, check_grad_out, check_inputs,
                            check_same_scores_dtype, check_w13_layout, wgrad_dtype)
from .arrays import clip_counts_tensor, float32_array, input_arrays, tensor_from_array, write_back


@dataclasses.dataclass
class RankGradients:
    """One rank's gradients: grad_w13 / grad_w2 have w13's / w2's shape, in Config.wgrad_dtype;
    grad_b13 / grad_b2 the biases' (None for a layer without expert biases)."""

    grad_x_TD: torch.Tensor
    grad_scores_TK: torch.Tensor
    grad_w13: torch.Tensor
    grad_w2: torch.Tensor
    grad_b13: Optional[torch.Tensor] = None
    grad_b2: Optional[torch.Tensor] = None


@dataclasses.dataclass
class _LastForward:
    engine: Any  # the poise._poise.ReferenceEngine that ran it
    arrays: list[list[np.ndarray]]  # its inputs, per input and rank
    weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per rank (scores_TK, w13, w2)


def _per_rank(name: str, values: Any, ep_size: int) -> list:
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence) or len(values) != ep_size:
        got = type(values).__name__ if not isinstance(values, Sequence) else f"{len(values)} items"
        raise InvalidArgument(name, f"expected a list of one tensor per rank ({ep_size}), got {got}")
    return list(values)


class Engine:
    """One MoE layer across ``ep_size`` virtual ranks on the CPU (the C++ poise::reference::Engine).

    ``forward`` keeps what ``backward`` needs, like a Context's activation slot; ``backward``
    differentiates the preceding forward. ``replica_slots``: replica expert slots per rank in exact
    balance (None: E_local, the training default).
    """

    def __init__(self, config: Config, ep_size: int, *, replica_slots: Optional[int] = None):
        self._cpp_config = to_cpp(config)
        self.ep_size = as_index("ep_size", ep_size)
        self._replica_slots = -1 if replica_slots is None else as_index("replica_slots", replica_slots)
        self._cpp_config.validate(self.ep_size)
        self._engines: dict[tuple[str, str], Any] = {}
        self._last: Optional[_LastForward] = None

    def _engine(self, scores_dtype: str, w13_layout: str) -> Any:
        key = (scores_dtype, w13_layout)
        if key not in self._engines:
            self._engines[key] = _poise.ReferenceEngine(
                self._cpp_config, self.ep_size, scores_dtype, w13_layout, self._replica_slots
            )
        return self._engines[key]

    def forward(
        self,
        x_TD: Sequence[torch.Tensor],
        ids_TK: Sequence[torch.Tensor],
        scores_TK: Sequence[torch.Tensor],
        w13: Sequence[torch.Tensor],
        w2: Sequence[torch.Tensor],
        *,
        w13_layout: str = "gate_up_blocked",
        b13: Optional[Sequence[torch.Tensor]] = None,
        b2: Optional[Sequence[torch.Tensor]] = None,
    ) -> list[torch.Tensor]:
        """Per rank: x_TD bf16 [T, D], ids_TK int32 [T, K], scores_TK bf16/fp32 [T, K], w13 bf16, w2 bf16;
        expert biases (both or neither) b13 bf16 [E_local, 2F] in W13's row order, b2 bf16 [E_local, D].

        Returns out_TD (bf16 [T, D]) per rank.
        """
        check_w13_layout(w13_layout)
        lists = [_per_rank(n, v, self.ep_size) for n, v in
                 (("x_TD", x_TD), ("ids_TK", ids_TK), ("scores_TK", scores_TK), ("w13", w13), ("w2", w2))]
        for r, inputs in enumerate(zip(*lists)):
            check_inputs(self._cpp_config, self.ep_size, "cpu", *inputs, prefix=f"rank {r}: ")
        check_same_scores_dtype(lists[2])
        engine = self._engine(SCORES_DTYPES[lists[2][0].dtype], w13_layout)
        biases = [] if b13 is None and b2 is None else [
            _per_rank(name, [None] * self.ep_size if value is None else value, self.ep_size)
            for name, value in (("b13", b13), ("b2", b2))]
        for r, pair in enumerate(zip(*biases)):  # one of them None: check_biases names it
            check_biases(self._cpp_config, self.ep_size, "cpu", *pair, prefix=f"rank {r}: ")
        arrays = input_arrays(*lists, *biases)
        out_TD = engine.forward(*arrays)
        self._last = _LastForward(engine, arrays, list(zip(lists[2], lists[3], lists[4])))
        return [tensor_from_array(out, torch.bfloat16, out.shape) for out in out_TD]

    def backward(
        self, grad_out_TD: Sequence[torch.Tensor], *, accumulate_into: Optional[Sequence[tuple]] = None
    ) -> list[RankGradients]:
        """Differentiates the preceding forward. grad_out_TD: bf16 [T, D] per rank.

        accumulate_into: per rank, a (grad_w13, grad_w2) pair of existing tensors (w13's / w2's shape,
        dtype Config.wgrad_dtype) that the weight grads are added to in place (fp32 sum, then
        rounded to wgrad_dtype); the returned grad_w13 / grad_w2 are then those same tensors.
        """
        last = self._require_forward("grad_out_TD", "backward needs a preceding forward on this Engine")
        grads = _per_rank("grad_out_TD", grad_out_TD, self.ep_size)
        for r, g in enumerate(grads):
            check_grad_out(self._cpp_config, "cpu", g, prefix=f"rank {r}: ")
        targets = None if accumulate_into is None else self._checked_targets(accumulate_into, last.weights)
        results = _run_backward(last.engine, last.arrays, [float32_array(g) for g in grads], targets)
        return [self._rank_gradients(result, weights, None if targets is None else targets[r])
                for r, (result, weights) in enumerate(zip(results, last.weights))]

    @property
    def routing_stats(self) -> Any:
        """RoutingStats of the last forward: expert_rows, owner_rows, computed_rows, replicas, ..."""
        return self._require_forward("routing_stats", "no forward has run on this Engine").engine.routing_stats

    @property
    def clip_counts(self) -> list[torch.Tensor]:
        """Per rank, int64 [E_local, 2] of the last forward: gate inputs above swiglu_limit and up
        inputs outside [-limit, limit] over every row of each local expert (counted on h13 as saved,
        bf16; zeros for plain SwiGLU)."""
        last = self._require_forward("clip_counts", "no forward has run on this Engine")
        return [clip_counts_tensor(c) for c in last.engine.clip_counts]

    def _require_forward(self, name: str, rule: str) -> _LastForward:
        if self._last is None:
            raise InvalidArgument(name, rule)
        return self._last

    def _checked_targets(self, accumulate_into: Sequence[tuple], weights: list[tuple]) -> list:
        targets = _per_rank("accumulate_into", accumulate_into, self.ep_size)
        for r, pair in enumerate(targets):
            _check_accumulation_pair(self._cpp_config, pair, weights[r][1], weights[r][2], f"rank {r}: ")
        return targets

    def _rank_gradients(self, result: tuple, weights: tuple, target: Optional[tuple]) -> RankGradients:
        """One rank's engine results as tensors: the weight grads written into ``target`` if given."""
        gx, gs, g13, g2, gb13, gb2 = result
        scores, w13, w2 = weights
        if target is not None:
            g13_t, g2_t = write_back(target[0], g13), write_back(target[1], g2)
        else:
            dtype = wgrad_dtype(self._cpp_config)
            g13_t, g2_t = tensor_from_array(g13, dtype, w13.shape), tensor_from_array(g2, dtype, w2.shape)
        dtype = wgrad_dtype(self._cpp_config)
        biases = [None, None] if gb13.size == 0 else [tensor_from_array(g, dtype, g.shape) for g in (gb13, gb2)]
        return RankGradients(tensor_from_array(gx, torch.bfloat16, gx.shape),
                             tensor_from_array(gs, scores.dtype, gs.shape), g13_t, g2_t, *biases)


def _run_backward(engine, arrays, grad_out_arrays, targets) -> list:
    if targets is None:
        return engine.backward(*arrays, grad_out_arrays, False, [], [])
    return engine.backward(*arrays, grad_out_arrays, True, [float32_array(t[0]) for t in targets],
                           [float32_array(t[1]) for t in targets])


def _check_accumulation_pair(config, pair, w13: torch.Tensor, w2: torch.Tensor, prefix: str) -> None:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise InvalidArgument("accumulate_into", f"{prefix}expected a (grad_w13, grad_w2) pair")
    check_accumulation_buffer("grad_w13", pair[0], w13, config, prefix)
    check_accumulation_buffer("grad_w2", pair[1], w2, config, prefix)
