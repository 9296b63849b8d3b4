"""The engine of a CUDA context: device pointers and the current stream into the C++ entry points.

No DLPack conversion and no hidden stream synchronization: the tensors' addresses go to
poise._poise.routed_experts_{forward,backward} (one rank) or *_ranks (every launch rank of a
virtual-ranks context), which launch on the caller's current stream.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional

import torch
from torch import Tensor

from .. import _poise
from ..context import Context
from .checks import SCORES_DTYPES, WEIGHT_GRAD_DTYPE_NAME
from .saved_state import call_identity

# (index, generation) of a C++ activation record; (-1, 0) names none, so the C++ side rebuilds it.
NO_RECORD = (-1, 0)


class CudaEngine:
    """A CUDA context's calls.

    ``forward_ranks`` / ``backward_ranks`` take one (x_TD, ids_TK, scores_TK, w13, w2) tuple per
    launch rank (one for a one-rank context, ep_size for a virtual-ranks context), or with expert
    biases (x_TD, ids_TK, scores_TK, w13, w2, b13, b2). ``weights_transposed``: the weights as
    stored for x @ W ([E_local, D, 2F] / [E_local, F, D]), which the GEMMs read in place.

    Each forward returns the C++ activation record (index, generation) that holds what its backward
    needs (a layer of the selected activation slot, or the working buffers); the engine remembers it
    by the inputs' identity and hands it to the backward, which runs from it, or first rebuilds the
    forward's routing, dispatch and W13 GEMM when a later forward overwrote it (decided on the host
    from generations, so a captured CUDA graph replays the same sequence).
    """

    # Records remembered (oldest dropped first): a dropped one costs its backward a recompute.
    _MAX_RECORDS = 256

    def __init__(self, context: Context):
        self._cpp = context._cpp  # not the Context: it owns this engine
        self._virtual_ranks = context.virtual_ranks
        self._ep_size = context.ep_size
        self._records: dict[tuple, tuple[int, int]] = {}
        self.forward_calls = 0
        self.backward_calls = 0

    @property
    def recomputed_forwards(self) -> int:
        """Backwards that rebuilt their forward (counted by the C++ context)."""
        return self._cpp.recomputed_forwards

    def reset(self) -> None:
        self._records.clear()

    # ---- one rank (poise.routed_experts) -----------------------------------------------------------

    def forward(self, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str, clip_counts: bool = False,
                biases: Optional[tuple[Tensor, Tensor]] = None, weights_transposed: bool = False,
                prepared: Optional[tuple[Tensor, ...]] = None):
        """out_TD, or (out_TD, clip_counts_E2) with ``clip_counts``. ``biases``: (b13, b2) or None.
        ``prepared``: the prepared FP8 weights (w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales), which
        the forward reads instead of quantizing w13 and w2, or None."""
        outs = self.forward_ranks([(x_TD, ids_TK, scores_TK, w13, w2, *(biases or ()))], w13_layout, clip_counts,
                                  weights_transposed, prepared)
        return (outs[0][0], outs[1][0]) if clip_counts else outs[0]

    def backward(self, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str, accumulate,
                 biases: Optional[tuple[Tensor, Tensor]] = None, weights_transposed: bool = False,
                 prepared_t: Optional[tuple[Tensor, ...]] = None):
        """(grad_x_TD, grad_scores_TK, grad_w13, grad_w2), and with ``biases`` (grad_b13, grad_b2).
        ``prepared_t``: the weights' prepared transposed FP8 copies (w13_fp8_t, w13_fp8_t_scales,
        w2_fp8_t, w2_fp8_t_scales), which DGRAD reads instead of quantizing its own, or None."""
        grads = self.backward_ranks([grad_out_TD], [(x_TD, ids_TK, scores_TK, w13, w2, *(biases or ()))], w13_layout,
                                    None if accumulate is None else [accumulate], weights_transposed, prepared_t)
        return tuple(per_rank[0] for per_rank in grads)

    # ---- every launch rank ---------------------------------------------------------------------------

    def forward_ranks(self, ranks: list[tuple], w13_layout: str, clip_counts: bool = False,
                      weights_transposed: bool = False, prepared: Optional[tuple[Tensor, ...]] = None):
        """Per rank out_TD, or (out_TD list, clip_counts_E2 list) with ``clip_counts``. ``prepared``:
        one-rank contexts only (forward's); not part of the call's identity (a backward reads w13
        and w2)."""
        out_TD = [torch.empty_like(inputs[0]) for inputs in ranks]
        counts = [self._empty_clip_counts(inputs[0].device) for inputs in ranks] if clip_counts else None
        # Nothing requires grad: no backward follows, take no slot position. (Grad mode cannot tell:
        # the op runs inside an autograd.Function forward, where it is always off.)
        keep = any(t.requires_grad for inputs in ranks for t in inputs)
        key = _identity(ranks, weights_transposed)
        self._records.pop(key, None)
        record = self._launch_forward(ranks, _Weights(w13_layout, weights_transposed), out_TD, counts, keep, prepared)
        if keep:
            self._remember(key, record)
        self.forward_calls += 1
        return (out_TD, counts) if clip_counts else out_TD

    def backward_ranks(self, grad_out_TD: list[Tensor], ranks: list[tuple], w13_layout: str,
                       accumulate: Optional[list[tuple]], weights_transposed: bool = False,
                       prepared_t: Optional[tuple[Tensor, ...]] = None):
        """Returns per-rank lists (grad_x_TD, grad_scores_TK, grad_w13, grad_w2), with biases also
        (grad_b13, grad_b2); the weight and bias grads in their tensors' dtype, or with ``accumulate``
        (per rank a tuple of Config.wgrad_dtype buffers, one per weight and bias) added into those
        buffers, which are returned."""
        record = self._records.pop(_identity(ranks, weights_transposed), NO_RECORD)  # a no_grad forward, or dropped
        grads = ([torch.empty_like(inputs[0]) for inputs in ranks], [torch.empty_like(inputs[2]) for inputs in ranks],
                 *_parameter_grad_outputs(ranks, accumulate))
        # Autograd would cast fp32 grads to the weights' bf16: without accumulation the kernels write
        # bf16 instead (the same bits, half the bytes, no cast pass). None: Config.wgrad_dtype.
        wgrad_dtype_name = WEIGHT_GRAD_DTYPE_NAME if accumulate is None else None
        self._launch_backward(ranks, _Weights(w13_layout, weights_transposed), grad_out_TD, grads,
                              accumulate is not None, record, wgrad_dtype_name, prepared_t)
        self.backward_calls += 1
        return grads

    # ---- helpers -------------------------------------------------------------------------------------

    def _empty_clip_counts(self, device: torch.device) -> Tensor:
        return torch.empty(self._cpp.config.num_local_experts(self._ep_size), 2, dtype=torch.int64, device=device)

    def _remember(self, key: tuple, record: tuple[int, int]) -> None:
        self._records[key] = record
        while len(self._records) > self._MAX_RECORDS:
            self._records.pop(next(iter(self._records)))

    def _launch_forward(self, ranks: list[tuple], weights: "_Weights", out_TD: list[Tensor],
                        clip_counts: Optional[list[Tensor]], keep_for_backward: bool,
                        prepared: Optional[tuple[Tensor, ...]] = None) -> tuple[int, int]:
        device = ranks[0][0].device
        stream = torch.cuda.current_stream(device).cuda_stream
        scores_dtype = SCORES_DTYPES[ranks[0][2].dtype]
        with torch.cuda.device(device):  # the pipeline allocates on the current device
            if self._virtual_ranks:
                assert prepared is None, "prepared FP8 weights: one-rank contexts only"
                return _poise.routed_experts_forward_ranks(
                    self._cpp, _column(ranks, 0), _column(ranks, 1), _column(ranks, 2), scores_dtype, _column(ranks, 3),
                    weights.w13_layout, _column(ranks, 4), _addresses(out_TD), stream,
                    _addresses(clip_counts) if clip_counts else [], keep_for_backward, _column(ranks, 5),
                    _column(ranks, 6), weights.transposed)
            (x, ids, scores, w13, w2, *biases), = ranks  # the scalar entry point: no lists on the one-rank hot path
            b13, b2 = (b.data_ptr() for b in biases) if biases else (0, 0)
            w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales = _addresses(prepared) if prepared else (0, 0, 0, 0)
            return _poise.routed_experts_forward(
                self._cpp, x.data_ptr(), ids.data_ptr(), scores.data_ptr(), scores_dtype, w13.data_ptr(),
                weights.w13_layout, w2.data_ptr(), out_TD[0].data_ptr(), stream,
                clip_counts[0].data_ptr() if clip_counts else 0, keep_for_backward, b13, b2, weights.transposed,
                w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales)

    def _launch_backward(self, ranks: list[tuple], weights: "_Weights", grad_out_TD: list[Tensor], grads: tuple,
                         accumulate: bool, record: tuple[int, int], wgrad_dtype_name: Optional[str],
                         prepared_t: Optional[tuple[Tensor, ...]] = None) -> None:
        grad_x_TD, grad_scores_TK, grad_w13, grad_w2, *grad_biases = grads
        device = ranks[0][0].device
        stream = torch.cuda.current_stream(device).cuda_stream
        scores_dtype = SCORES_DTYPES[ranks[0][2].dtype]
        with torch.cuda.device(device):
            if self._virtual_ranks:
                assert prepared_t is None, "prepared FP8 weights: one-rank contexts only"
                grad_b13, grad_b2 = (_addresses(g) for g in grad_biases) if grad_biases else ([], [])
                _poise.routed_experts_backward_ranks(
                    self._cpp, _column(ranks, 0), _column(ranks, 1), _column(ranks, 2), scores_dtype, _column(ranks, 3),
                    weights.w13_layout, _column(ranks, 4), _addresses(grad_out_TD), _addresses(grad_x_TD),
                    _addresses(grad_scores_TK), _addresses(grad_w13), _addresses(grad_w2), accumulate,
                    stream, record, wgrad_dtype_name, _column(ranks, 5), _column(ranks, 6), weights.transposed,
                    grad_b13, grad_b2)
                return
            (x, ids, scores, w13, w2, *biases), = ranks  # the scalar entry point: no lists on the one-rank hot path
            b13, b2, grad_b13, grad_b2 = (
                (biases[0].data_ptr(), biases[1].data_ptr(), grad_biases[0][0].data_ptr(), grad_biases[1][0].data_ptr())
                if biases else (0, 0, 0, 0))
            _poise.routed_experts_backward(
                self._cpp, x.data_ptr(), ids.data_ptr(), scores.data_ptr(), scores_dtype, w13.data_ptr(),
                weights.w13_layout, w2.data_ptr(), grad_out_TD[0].data_ptr(), grad_x_TD[0].data_ptr(),
                grad_scores_TK[0].data_ptr(), grad_w13[0].data_ptr(), grad_w2[0].data_ptr(),
                accumulate, stream, record, wgrad_dtype_name, b13, b2, weights.transposed, grad_b13, grad_b2,
                *(_addresses(prepared_t) if prepared_t else (0, 0, 0, 0)))


class _Weights(NamedTuple):
    """How a call's weights are laid out: the same for every rank."""

    w13_layout: str
    transposed: bool


def _parameter_grad_outputs(ranks: list[tuple], accumulate: Optional[list[tuple]]) -> list[list[Tensor]]:
    """Per weight (w13, w2, then b13, b2 with biases) the grads of every rank: new tensors of the
    parameter's dtype, or the accumulation buffers."""
    if accumulate is None:
        return [[torch.empty_like(inputs[i]) for inputs in ranks] for i in range(3, len(ranks[0]))]
    return [list(per_weight) for per_weight in zip(*accumulate)]


def _addresses(tensors: Iterable[Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


def _column(ranks: list[tuple], input_index: int) -> list[int]:
    """Every rank's address of one input (0 x_TD, 1 ids_TK, 2 scores_TK, 3 w13, 4 w2, 5 b13, 6 b2),
    an empty list for biases the call does not have."""
    return _addresses(r[input_index] for r in ranks if input_index < len(r))


def _identity(ranks: list[tuple], weights_transposed: bool) -> tuple:
    return (weights_transposed, call_identity([t for inputs in ranks for t in inputs]))
