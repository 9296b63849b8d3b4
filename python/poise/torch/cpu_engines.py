"""The engines of a CPU context: its calls run on the C++ reference engine.

- ``CpuRankEngine``: a one-rank context (poise.routed_experts), alone or in a torch.distributed
  group whose ranks each run the whole group's layer.
- ``CpuVirtualRanksEngine``: a virtual-ranks context (poise.routed_experts_virtual), every rank in
  this process on a poise.reference.Engine.

Both keep their latest forward for its backward and recompute any other (saved_state.LatestForward),
as a GPU backward rebuilds what its activation slot did not keep.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from .. import _poise
from ..reference.arrays import clip_counts_tensor, float32_array, int32_array, tensor_from_array, write_back
from ..reference.engines import Engine
from .checks import SCORES_DTYPES
from .saved_state import LatestForward, call_identity


class CpuRankEngine(LatestForward):
    """Runs a one-rank CPU Context's calls on the reference engine.

    No group: an ep_size-1 engine. A torch.distributed group of R ranks: every rank all-gathers the
    call's inputs and runs the R-rank engine, keeping its own rank's results (R times the work: a
    reference, not a fast path). Collective like the GPU call. With a group, backward always
    recomputes its forward, so every rank takes the same path.
    """

    def __init__(self, context: Any):
        self._config = context._cpp.config
        self._ep_size = context.ep_size
        self._rank = context.rank
        self._group = context.group
        self._engines: dict[tuple[str, str], Any] = {}
        super().__init__()

    def forward(self, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str, clip_counts: bool = False,
                biases: Optional[tuple[torch.Tensor, torch.Tensor]] = None, weights_transposed: bool = False):
        """out_TD, or (out_TD, clip_counts_E2) with ``clip_counts``. ``biases``: (b13, b2) or None."""
        engine, arrays, key = self._prepare(x_TD, ids_TK, scores_TK, w13, w2, w13_layout, biases, weights_transposed)
        out_TD = self._run_forward(key, lambda: engine.forward(*arrays))[self._rank]
        self.forward_calls += 1
        out = torch.from_numpy(out_TD).to(torch.bfloat16)
        return (out, clip_counts_tensor(engine.clip_counts[self._rank])) if clip_counts else out

    def backward(self, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str,
                 accumulate: Optional[tuple[torch.Tensor, ...]],
                 biases: Optional[tuple[torch.Tensor, torch.Tensor]] = None, weights_transposed: bool = False):
        """Returns (grad_x_TD, grad_scores_TK, grad_w13, grad_w2), and with ``biases`` also
        (grad_b13, grad_b2); with ``accumulate`` (a buffer per weight, and per bias with biases) adds
        those grads into the buffers in place and returns the buffers in their place."""
        engine, arrays, key = self._prepare(x_TD, ids_TK, scores_TK, w13, w2, w13_layout, biases, weights_transposed)
        self._ensure_forward(key, lambda: engine.forward(*arrays), always=self._group is not None)
        grad_out = self._gather([float32_array(grad_out_TD)])[0]
        buffers = self._accumulation_arrays(arrays, accumulate, weights_transposed)
        results = engine.backward(*arrays, grad_out, accumulate is not None, *buffers)
        self.backward_calls += 1
        gx, gs, *parameter_grads = results[self._rank]
        grads = (torch.from_numpy(gx).to(torch.bfloat16), torch.from_numpy(gs).to(scores_TK.dtype))
        as_stored = [_grad_as_stored(g, weights_transposed) for g in parameter_grads]
        if accumulate is not None:
            return (*grads, *(write_back(buffer, g) for buffer, g in zip(accumulate, as_stored)))
        # Without accumulation the parameter grads come in the parameters' dtype, as from the GPU engine.
        parameters = (w13, w2, *(biases or ()))
        return (*grads, *(tensor_from_array(g, p.dtype, p.shape) for p, g in zip(parameters, as_stored)))

    def _routing_stats(self) -> Any:
        return self._latest[0].routing_stats  # the key's engine: the one that ran the latest forward

    def _prepare(self, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str, biases: Optional[tuple],
                 weights_transposed: bool) -> tuple[Any, list, tuple]:
        """(the engine for this call, every rank's input arrays, the key of this forward)."""
        engine = self._engine(SCORES_DTYPES[scores_TK.dtype], w13_layout)
        tensors = (x_TD, ids_TK, scores_TK, w13, w2, *(biases or ()))
        w13_ref, w2_ref = (swap_weight_layout(w, weights_transposed) for w in (w13, w2))
        arrays = self._gather([float32_array(x_TD), int32_array(ids_TK), float32_array(scores_TK),
                               float32_array(w13_ref), float32_array(w2_ref),
                               *(float32_array(b) for b in biases or ())])
        arrays += [[], []] if biases is None else []  # the engine's b13, b2 lists: empty without biases
        return engine, arrays, (engine, weights_transposed, call_identity(tensors))

    def _engine(self, scores_dtype: str, w13_layout: str) -> Any:
        key = (scores_dtype, w13_layout)
        if key not in self._engines:
            self._engines[key] = _poise.ReferenceEngine(self._config, self._ep_size, scores_dtype, w13_layout, -1)
        return self._engines[key]

    def _gather(self, arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Per input, the arrays of every rank (this rank's own without a group)."""
        if self._group is None:
            return [[a] for a in arrays]
        import torch.distributed as dist

        gathered = []
        for a in arrays:
            local = torch.from_numpy(a)
            parts = [torch.empty_like(local) for _ in range(self._ep_size)]
            dist.all_gather(parts, local, group=self._group)
            gathered.append([p.numpy() for p in parts])
        return gathered

    def _accumulation_arrays(self, arrays: list[list[np.ndarray]], accumulate: Optional[tuple],
                             weights_transposed: bool) -> tuple[list, ...]:
        """The engine's accumulation arrays of every rank, one list per weight (and per bias with
        biases): this rank's buffers (in the engine's layout), zeros for the other ranks (their
        results are theirs to compute); empty lists without accumulation."""
        if accumulate is None:
            return [], [], [], []
        per_parameter = []
        for index, buffer in zip((3, 4, 5, 6), accumulate):
            lists = [np.zeros_like(a) for a in arrays[index]]
            lists[self._rank] = float32_array(swap_weight_layout(buffer, weights_transposed and index < 5))
            per_parameter.append(lists)
        return tuple(per_parameter + [[]] * (4 - len(per_parameter)))


class CpuVirtualRanksEngine(LatestForward):
    """Runs a CPU virtual-ranks Context's calls (every rank in this process) on a reference.Engine,
    with the CUDA engine's interface for virtual ranks: one (x_TD, ids_TK, scores_TK, w13, w2) tuple
    per rank."""

    def __init__(self, context: Any):
        self._engine = Engine(context.config, context.ep_size)
        super().__init__()

    def forward_ranks(self, ranks: Sequence[tuple], w13_layout: str, clip_counts: bool = False,
                      weights_transposed: bool = False):
        """Per rank out_TD, or (out_TD list, clip_counts_E2 list) with ``clip_counts``."""
        key = self._key(ranks, w13_layout, weights_transposed)
        out_TD = self._run_forward(key, lambda: self._forward(ranks, w13_layout, weights_transposed))
        self.forward_calls += 1
        return (out_TD, self._engine.clip_counts) if clip_counts else out_TD

    def backward_ranks(self, grad_out_TD: Sequence[torch.Tensor], ranks: Sequence[tuple], w13_layout: str,
                       accumulate: Optional[Sequence[tuple]],
                       weights_transposed: bool = False) -> tuple[list, list, list, list]:
        key = self._key(ranks, w13_layout, weights_transposed)
        self._ensure_forward(key, lambda: self._forward(ranks, w13_layout, weights_transposed))
        grads = self._engine.backward(list(grad_out_TD), accumulate_into=accumulate)
        self.backward_calls += 1
        grad_w13, grad_w2 = ([swap_weight_layout(getattr(g, name), weights_transposed).contiguous() for g in grads]
                             for name in ("grad_w13", "grad_w2"))
        if accumulate is None:  # in the weights' dtype, as from the GPU engine (one rounding of the fp32 sums)
            grad_w13 = [g.to(r[3].dtype) for g, r in zip(grad_w13, ranks)]
            grad_w2 = [g.to(r[4].dtype) for g, r in zip(grad_w2, ranks)]
        return [g.grad_x_TD for g in grads], [g.grad_scores_TK for g in grads], grad_w13, grad_w2

    def _routing_stats(self) -> Any:
        return self._engine.routing_stats

    def _forward(self, ranks: Sequence[tuple], w13_layout: str, weights_transposed: bool) -> list[torch.Tensor]:
        x_TD, ids_TK, scores_TK, w13, w2 = (list(column) for column in zip(*ranks))
        w13, w2 = ([swap_weight_layout(w, weights_transposed).contiguous() for w in ws] for ws in (w13, w2))
        return self._engine.forward(x_TD, ids_TK, scores_TK, w13, w2, w13_layout=w13_layout)

    @staticmethod
    def _key(ranks: Sequence[tuple], w13_layout: str, weights_transposed: bool) -> tuple:
        return (w13_layout, weights_transposed, call_identity([t for inputs in ranks for t in inputs]))


def swap_weight_layout(weight: torch.Tensor, weights_transposed: bool) -> torch.Tensor:
    """With ``weights_transposed``, a weight (or its grad) in the other of the two layouts, as a view:
    [E_local, D, 2F] / [E_local, F, D] as stored for x @ W <-> [E_local, 2F, D] / [E_local, D, F], the
    reference engine's (the transpose is its own inverse). Else the weight itself."""
    return weight.transpose(1, 2) if weights_transposed else weight


def _grad_as_stored(grad: np.ndarray, weights_transposed: bool) -> np.ndarray:
    """A parameter's grad from the engine (the reference layout) in the parameter's memory order: a
    transposed weight's transposed back, a bias's as it is."""
    return np.ascontiguousarray(grad.swapaxes(1, 2)) if weights_transposed and grad.ndim == 3 else grad
