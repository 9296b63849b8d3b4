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
                biases: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """out_TD, or (out_TD, clip_counts_E2) with ``clip_counts``. ``biases``: (b13, b2) or None."""
        engine, arrays, key = self._prepare(x_TD, ids_TK, scores_TK, w13, w2, w13_layout, biases)
        out_TD = self._run_forward(key, lambda: engine.forward(*arrays))[self._rank]
        self.forward_calls += 1
        out = torch.from_numpy(out_TD).to(torch.bfloat16)
        return (out, clip_counts_tensor(engine.clip_counts[self._rank])) if clip_counts else out

    def backward(self, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str,
                 accumulate: Optional[tuple[torch.Tensor, torch.Tensor]],
                 biases: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """Returns (grad_x_TD, grad_scores_TK, grad_w13, grad_w2), and with ``biases`` also
        (grad_b13, grad_b2); with ``accumulate`` (two buffers, no biases), adds the weight grads into
        them in place and returns them as grad_w13, grad_w2."""
        engine, arrays, key = self._prepare(x_TD, ids_TK, scores_TK, w13, w2, w13_layout, biases)
        self._ensure_forward(key, lambda: engine.forward(*arrays), always=self._group is not None)
        grad_out = self._gather([float32_array(grad_out_TD)])[0]
        buffers = self._accumulation_arrays(arrays, accumulate)
        results = engine.backward(*arrays, grad_out, accumulate is not None, *buffers)
        self.backward_calls += 1
        gx, gs, g13, g2, gb13, gb2 = results[self._rank]
        grad_x = torch.from_numpy(gx).to(torch.bfloat16)
        grad_scores = torch.from_numpy(gs).to(scores_TK.dtype)
        if accumulate is not None:
            return grad_x, grad_scores, write_back(accumulate[0], g13), write_back(accumulate[1], g2)
        # Without accumulation the weight grads come in the weights' dtype, as from the GPU engine.
        grads = (grad_x, grad_scores, tensor_from_array(g13, w13.dtype, w13.shape),
                 tensor_from_array(g2, w2.dtype, w2.shape))
        if biases is None:
            return grads
        return (*grads, *(tensor_from_array(g, b.dtype, b.shape) for g, b in zip((gb13, gb2), biases)))

    def _routing_stats(self) -> Any:
        return self._latest[0].routing_stats  # the key's engine: the one that ran the latest forward

    def _prepare(self, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str,
                 biases: Optional[tuple] = None) -> tuple[Any, list, tuple]:
        """(the engine for this call, every rank's input arrays, the key of this forward)."""
        engine = self._engine(SCORES_DTYPES[scores_TK.dtype], w13_layout)
        tensors = (x_TD, ids_TK, scores_TK, w13, w2, *(biases or ()))
        arrays = self._gather([float32_array(x_TD), int32_array(ids_TK), float32_array(scores_TK),
                               float32_array(w13), float32_array(w2), *(float32_array(b) for b in biases or ())])
        arrays += [[], []] if biases is None else []  # the engine's b13, b2 lists: empty without biases
        return engine, arrays, (engine, call_identity(tensors))

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

    def _accumulation_arrays(self, arrays: list[list[np.ndarray]], accumulate: Optional[tuple]) -> tuple[list, list]:
        """The engine's (grad_w13, grad_w2) accumulation arrays of every rank: this rank's buffers,
        zeros for the others (their results are theirs to compute); empty without accumulation."""
        if accumulate is None:
            return [], []
        acc13, acc2 = [np.zeros_like(a) for a in arrays[3]], [np.zeros_like(a) for a in arrays[4]]
        acc13[self._rank], acc2[self._rank] = float32_array(accumulate[0]), float32_array(accumulate[1])
        return acc13, acc2


class CpuVirtualRanksEngine(LatestForward):
    """Runs a CPU virtual-ranks Context's calls (every rank in this process) on a reference.Engine,
    with the CUDA engine's interface for virtual ranks: one (x_TD, ids_TK, scores_TK, w13, w2) tuple
    per rank."""

    def __init__(self, context: Any):
        self._engine = Engine(context.config, context.ep_size)
        super().__init__()

    def forward_ranks(self, ranks: Sequence[tuple], w13_layout: str, clip_counts: bool = False):
        """Per rank out_TD, or (out_TD list, clip_counts_E2 list) with ``clip_counts``."""
        out_TD = self._run_forward(self._key(ranks, w13_layout), lambda: self._forward(ranks, w13_layout))
        self.forward_calls += 1
        return (out_TD, self._engine.clip_counts) if clip_counts else out_TD

    def backward_ranks(self, grad_out_TD: Sequence[torch.Tensor], ranks: Sequence[tuple], w13_layout: str,
                       accumulate: Optional[Sequence[tuple]]) -> tuple[list, list, list, list]:
        self._ensure_forward(self._key(ranks, w13_layout), lambda: self._forward(ranks, w13_layout))
        grads = self._engine.backward(list(grad_out_TD), accumulate_into=accumulate)
        self.backward_calls += 1
        grad_w13, grad_w2 = [g.grad_w13 for g in grads], [g.grad_w2 for g in grads]
        if accumulate is None:  # in the weights' dtype, as from the GPU engine (one rounding of the fp32 sums)
            grad_w13 = [g.to(r[3].dtype) for g, r in zip(grad_w13, ranks)]
            grad_w2 = [g.to(r[4].dtype) for g, r in zip(grad_w2, ranks)]
        return [g.grad_x_TD for g in grads], [g.grad_scores_TK for g in grads], grad_w13, grad_w2

    def _routing_stats(self) -> Any:
        return self._engine.routing_stats

    def _forward(self, ranks: Sequence[tuple], w13_layout: str) -> list[torch.Tensor]:
        return self._engine.forward(*[list(column) for column in zip(*ranks)], w13_layout=w13_layout)

    @staticmethod
    def _key(ranks: Sequence[tuple], w13_layout: str) -> tuple:
        return (w13_layout, call_identity([t for inputs in ranks for t in inputs]))
