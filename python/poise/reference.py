"""The CPU reference engine from PyTorch: virtual ranks in one process, the float64 oracles, and
the engine behind a CPU Context.

- ``Engine(config, ep_size)``: one MoE layer across ``ep_size`` virtual ranks (threads of the C++
  engine). ``forward`` and ``backward`` take one tensor per rank for each argument.
- ``dense_float64(...)``: the C++ float64 oracle (dense loops, no ranks, no rounding).
- ``routed_experts_torch(...)``: the same layer in plain PyTorch ops (differentiable, any dtype),
  written independently of the C++ code: tests compare both engines' grads with its autograd.
- ``ContextEngine``: what the torch ops run on for a Context created with device='cpu'.

Tensors cross to C++ as float32 numpy arrays; bf16 values are exact in float32, so nothing is
rounded at the boundary. See docs/pytorch.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as functional

from . import _poise
from .config import Config, to_cpp
from .errors import InvalidArgument, as_index
from .latest_forward import LatestForward
from .torch_checks import SCORES_DTYPES, check_grad_out, check_inputs, check_w13_layout, wgrad_dtype


def _float32_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def _int32_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _from_numpy(array: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return torch.from_numpy(array).reshape(shape).to(dtype)


@dataclasses.dataclass
class RankGradients:
    """One rank's gradients: grad_w13 / grad_w2 have w13's / w2's shape, in Config.wgrad_dtype."""

    grad_x_TD: torch.Tensor
    grad_scores_TK: torch.Tensor
    grad_w13: torch.Tensor
    grad_w2: torch.Tensor


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
        self._last: Optional[tuple[Any, list[list[np.ndarray]], list[tuple[torch.Tensor, torch.Tensor]]]] = None

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
    ) -> list[torch.Tensor]:
        """Per rank: x_TD bf16 [T, D], ids_TK int32 [T, K], scores_TK bf16/fp32 [T, K], w13 bf16, w2 bf16.

        Returns out_TD (bf16 [T, D]) per rank.
        """
        check_w13_layout(w13_layout)
        lists = [_per_rank(n, v, self.ep_size) for n, v in
                 (("x_TD", x_TD), ("ids_TK", ids_TK), ("scores_TK", scores_TK), ("w13", w13), ("w2", w2))]
        for r, (x, ids, scores, a, b) in enumerate(zip(*lists)):
            check_inputs(self._cpp_config, self.ep_size, "cpu", x, ids, scores, a, b, prefix=f"rank {r}: ")
        scores_dtypes = {s.dtype for s in lists[2]}
        if len(scores_dtypes) != 1:
            raise InvalidArgument("scores_TK", f"every rank must use the same dtype, got {sorted(map(str, scores_dtypes))}")
        engine = self._engine(SCORES_DTYPES[lists[2][0].dtype], w13_layout)
        arrays = _to_arrays(*lists)
        out_TD = engine.forward(*arrays)
        self._last = (engine, arrays, [(s, a, b) for s, a, b in zip(lists[2], lists[3], lists[4])])
        return [_from_numpy(out, torch.bfloat16, out.shape) for out in out_TD]

    def backward(
        self, grad_out_TD: Sequence[torch.Tensor], *, accumulate_into: Optional[Sequence[tuple]] = None
    ) -> list[RankGradients]:
        """Differentiates the preceding forward. grad_out_TD: bf16 [T, D] per rank.

        accumulate_into: per rank, a (grad_w13, grad_w2) pair of existing tensors (w13's / w2's shape,
        dtype Config.wgrad_dtype) that the weight grads are added to in place (fp32 sum, then
        rounded to wgrad_dtype); the returned grad_w13 / grad_w2 are then those same tensors.
        """
        if self._last is None:
            raise InvalidArgument("grad_out_TD", "backward needs a preceding forward on this Engine")
        engine, arrays, weights = self._last
        grads = _per_rank("grad_out_TD", grad_out_TD, self.ep_size)
        for r, g in enumerate(grads):
            check_grad_out(self._cpp_config, "cpu", g, prefix=f"rank {r}: ")
        targets = None
        if accumulate_into is not None:
            targets = _per_rank("accumulate_into", accumulate_into, self.ep_size)
            for r, pair in enumerate(targets):
                _check_accumulation_pair(self._cpp_config, pair, weights[r][1], weights[r][2], f"rank {r}: ")
        results = _run_backward(engine, arrays, [_float32_numpy(g) for g in grads], targets)
        dtype = wgrad_dtype(self._cpp_config)
        out = []
        for r, (gx, gs, g13, g2) in enumerate(results):
            scores, w13, w2 = weights[r]
            if targets is not None:
                g13_t, g2_t = _write_back(targets[r][0], g13), _write_back(targets[r][1], g2)
            else:
                g13_t, g2_t = _from_numpy(g13, dtype, w13.shape), _from_numpy(g2, dtype, w2.shape)
            out.append(RankGradients(_from_numpy(gx, torch.bfloat16, gx.shape),
                                     _from_numpy(gs, scores.dtype, gs.shape), g13_t, g2_t))
        return out

    @property
    def routing_stats(self) -> Any:
        """RoutingStats of the last forward: expert_rows, owner_rows, computed_rows, replicas, ..."""
        if self._last is None:
            raise InvalidArgument("routing_stats", "no forward has run on this Engine")
        return self._last[0].routing_stats

    @property
    def clip_counts(self) -> list[torch.Tensor]:
        """Per rank, int64 [E_local, 2] of the last forward: gate inputs above swiglu_limit and up
        inputs outside [-limit, limit] over every row of each local expert (counted on h13 as saved,
        bf16; zeros for plain SwiGLU)."""
        if self._last is None:
            raise InvalidArgument("clip_counts", "no forward has run on this Engine")
        return [_clip_counts_tensor(c) for c in self._last[0].clip_counts]


def _clip_counts_tensor(counts: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(counts), dtype=torch.int64).reshape(-1, 2)


def _to_arrays(x_TD, ids_TK, scores_TK, w13, w2) -> list[list[np.ndarray]]:
    return [[_float32_numpy(t) for t in x_TD], [_int32_numpy(t) for t in ids_TK],
            [_float32_numpy(t) for t in scores_TK], [_float32_numpy(t) for t in w13], [_float32_numpy(t) for t in w2]]


def _run_backward(engine, arrays, grad_out_arrays, targets) -> list:
    if targets is None:
        return engine.backward(*arrays, grad_out_arrays, False, [], [])
    return engine.backward(*arrays, grad_out_arrays, True, [_float32_numpy(t[0]) for t in targets],
                           [_float32_numpy(t[1]) for t in targets])


def _write_back(target: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """The engine's accumulated values (already in wgrad_dtype) into the caller's tensor, in place."""
    with torch.no_grad():
        target.copy_(torch.from_numpy(values).reshape(target.shape))
    return target


def _check_accumulation_pair(config, pair, w13: torch.Tensor, w2: torch.Tensor, prefix: str) -> None:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise InvalidArgument("accumulate_into", f"{prefix}expected a (grad_w13, grad_w2) pair")
    check_accumulation_buffer("grad_w13", pair[0], w13, config, prefix)
    check_accumulation_buffer("grad_w2", pair[1], w2, config, prefix)


def check_accumulation_buffer(name: str, target: Any, weight: torch.Tensor, config: Any, prefix: str = "") -> None:
    """An accumulation buffer: a contiguous tensor of the weight's shape and device, in wgrad_dtype."""
    dtype = wgrad_dtype(config)
    if not isinstance(target, torch.Tensor):
        raise InvalidArgument(name, f"{prefix}must be a torch.Tensor, got {type(target).__name__}")
    if target.shape != weight.shape or target.device != weight.device:
        raise InvalidArgument(name, f"{prefix}must have the weight's shape {list(weight.shape)} and device "
                                    f"{weight.device}, got {list(target.shape)} on {target.device}")
    if target.dtype != dtype:
        raise InvalidArgument(name, f"{prefix}must be {dtype} (Config.wgrad_dtype={config.wgrad_dtype}), got {target.dtype}")
    if not target.is_contiguous():
        raise InvalidArgument(name, f"{prefix}must be contiguous")


# ---- oracles -----------------------------------------------------------------------------------


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
) -> dict[str, list[torch.Tensor]]:
    """The C++ float64 oracle. Returns {'out_TD': [...]} and, with grad_out_TD, 'grad_x_TD',
    'grad_scores_TK', 'grad_w13' [E_local, 2F, D] and 'grad_w2' [E_local, D, F]: float64 per rank."""
    cpp = to_cpp(config)
    ep_size = as_index("ep_size", ep_size)
    check_w13_layout(w13_layout)
    scores_dtype = SCORES_DTYPES.get(scores_TK[0].dtype) if len(scores_TK) else None
    if scores_dtype is None:
        raise InvalidArgument("scores_TK", "must be a non-empty list of bf16 or fp32 tensors")
    grads = [] if grad_out_TD is None else [_float32_numpy(g) for g in grad_out_TD]
    result = _poise.reference_dense_float64(cpp, ep_size, scores_dtype, w13_layout,
                                            *_to_arrays(x_TD, ids_TK, scores_TK, w13, w2), grads)
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
) -> torch.Tensor:
    """The layer in plain PyTorch: out[t] = sum_k scores[t,k] * W2_e act(W13_e x[t]), e = ids[t,k].

    Takes the global experts (w13_E2FD [E, 2F, D], w2_EDF [E, D, F]: every rank's local experts in
    rank order) and computes in the tensors' dtype (float64 for an oracle). Differentiable.
    """
    F = w13_E2FD.shape[1] // 2
    out_TD = torch.zeros_like(x_TD)
    ids = ids_TK.long()
    for e in range(w13_E2FD.shape[0]):
        tokens, picks = torch.nonzero(ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = x_TD[tokens] @ w13_E2FD[e].T
        if w13_layout == "gate_up_blocked":
            h_gate, h_up = h[:, :F], h[:, F:]
        else:
            h_gate, h_up = h[:, 0::2], h[:, 1::2]
        y = swiglu_torch(h_gate, h_up, config) @ w2_EDF[e].T
        out_TD = out_TD.index_add(0, tokens, scores_TK[tokens, picks].unsqueeze(1) * y)
    return out_TD


# ---- random inputs -------------------------------------------------------------------------------

ROUTINGS = ("uniform", "one_expert", "first_rank")


def random_inputs(
    config: Config,
    ep_size: int,
    *,
    seed: int = 0,
    scores_dtype: torch.dtype = torch.float32,
    routing: str = "uniform",
    padding_rows: int = 0,
    w13_shape: str = "E2FD",
) -> dict[str, list[torch.Tensor]]:
    """Random inputs of every rank: {'x_TD', 'ids_TK', 'scores_TK', 'w13', 'w2'} -> per-rank lists.

    x ~ N(0, 1), W13 ~ N(0, 1/D), W2 ~ N(0, 1/F) in bf16; scores a softmax over the K picks;
    K distinct experts per token. routing: 'uniform'; 'one_expert' (every token picks expert 0,
    its other picks uniform); 'first_rank' (every pick among rank 0's experts: needs K <= E_local).
    The last ``padding_rows`` tokens of every rank get zero scores. w13_shape: 'E2FD' [E_local, 2F,
    D], 'E2_F_D' [E_local, 2, F, D] or 'flat' [E_local*2F, D] (w2 then [E_local*D, F]).
    """
    T, D, F = config.num_local_input_tokens, config.hidden_dim, config.intermediate_dim
    K, E = config.top_k, config.num_experts
    L = E // ep_size
    if routing not in ROUTINGS:
        raise InvalidArgument("routing", f"must be one of {ROUTINGS}, got {routing!r}")
    if routing == "first_rank" and K > L:
        raise InvalidArgument("routing", f"'first_rank' needs top_k <= E_local ({K} > {L})")
    generator = torch.Generator().manual_seed(seed)
    w13_shapes = {"E2FD": (L, 2 * F, D), "E2_F_D": (L, 2, F, D), "flat": (L * 2 * F, D)}
    if w13_shape not in w13_shapes:
        raise InvalidArgument("w13_shape", f"must be one of {sorted(w13_shapes)}, got {w13_shape!r}")
    w2_shape = (L * D, F) if w13_shape == "flat" else (L, D, F)

    def normal(*shape, std=1.0):
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")}
    for _ in range(ep_size):
        if routing == "first_rank":
            ids = torch.rand(T, L, generator=generator).argsort(dim=1)[:, :K]
        elif routing == "one_expert":
            others = torch.rand(T, E - 1, generator=generator).argsort(dim=1)[:, : K - 1] + 1
            ids = torch.cat([torch.zeros(T, 1, dtype=torch.long), others], dim=1)
        else:
            ids = torch.rand(T, E, generator=generator).argsort(dim=1)[:, :K]
        scores = torch.randn(T, K, generator=generator).softmax(dim=1)
        if padding_rows:
            scores[T - padding_rows:] = 0
        inputs["x_TD"].append(normal(T, D))
        inputs["ids_TK"].append(ids.to(torch.int32))
        inputs["scores_TK"].append(scores.to(scores_dtype))
        inputs["w13"].append(normal(*w13_shapes[w13_shape], std=D**-0.5))
        inputs["w2"].append(normal(*w2_shape, std=F**-0.5))
    return inputs


def global_experts(w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], config: Config) -> tuple:
    """Every rank's local experts, in rank order: (w13_E2FD [E, 2F, D], w2_EDF [E, D, F])."""
    D, F = config.hidden_dim, config.intermediate_dim
    return (torch.cat([w.reshape(-1, 2 * F, D) for w in w13]), torch.cat([w.reshape(-1, D, F) for w in w2]))


# ---- the engine of a CPU Context ---------------------------------------------------------------


def call_identity(tensors: Sequence[torch.Tensor]) -> tuple:
    """Tells whether a backward's inputs are those of the last forward: same memory, shape, dtype
    and version counter mean the same values (views share the version counter)."""
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype, t._version) for t in tensors)


class ContextEngine(LatestForward):
    """Runs a CPU Context's calls on the reference engine.

    One rank (no group): an ep_size-1 engine. A torch.distributed group of R ranks: every rank
    all-gathers the call's inputs and runs the R-rank engine, keeping its own rank's results (R
    times the work: a reference, not a fast path). Collective like the GPU call.

    Saved state: the engine keeps what backward needs from its last forward. A backward whose
    forward was not the last one (several layers sharing a context, a no_grad forward in between)
    recomputes its forward first, as a GPU backward recomputes what its activation slot did not
    keep. With a group, backward always recomputes, so every rank takes the same path.
    """

    def __init__(self, context: Any):
        self._config = context._cpp.config
        self._ep_size = context.ep_size
        self._rank = context.rank
        self._group = context.group
        self._engines: dict[tuple[str, str], Any] = {}
        super().__init__()

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

    def forward(self, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str, clip_counts: bool = False):
        """out_TD, or (out_TD, clip_counts_E2) with ``clip_counts``."""
        inputs = (x_TD, ids_TK, scores_TK, w13, w2)
        engine = self._engine(SCORES_DTYPES[scores_TK.dtype], w13_layout)
        arrays = self._gather([_float32_numpy(x_TD), _int32_numpy(ids_TK), _float32_numpy(scores_TK),
                               _float32_numpy(w13), _float32_numpy(w2)])
        out_TD = self._run_forward((engine, call_identity(inputs)), lambda: engine.forward(*arrays))[self._rank]
        self.forward_calls += 1
        out = torch.from_numpy(out_TD).to(torch.bfloat16)
        return (out, _clip_counts_tensor(engine.clip_counts[self._rank])) if clip_counts else out

    def backward(self, grad_out_TD, x_TD, ids_TK, scores_TK, w13, w2, w13_layout: str,
                 accumulate: Optional[tuple[torch.Tensor, torch.Tensor]]):
        """Returns (grad_x_TD, grad_scores_TK, grad_w13, grad_w2); with ``accumulate`` (two
        buffers), adds the weight grads into them in place and returns them as grad_w13, grad_w2."""
        inputs = (x_TD, ids_TK, scores_TK, w13, w2)
        engine = self._engine(SCORES_DTYPES[scores_TK.dtype], w13_layout)
        arrays = self._gather([_float32_numpy(x_TD), _int32_numpy(ids_TK), _float32_numpy(scores_TK),
                               _float32_numpy(w13), _float32_numpy(w2)])
        self._ensure_forward((engine, call_identity(inputs)), lambda: engine.forward(*arrays),
                             always=self._group is not None)
        grad_out = self._gather([_float32_numpy(grad_out_TD)])[0]
        if accumulate is None:
            results = engine.backward(*arrays, grad_out, False, [], [])
        else:
            # The engine wants every rank's buffers; other ranks' results are theirs to compute.
            acc13, acc2 = ([np.zeros_like(a) for a in arrays[3]], [np.zeros_like(a) for a in arrays[4]])
            acc13[self._rank], acc2[self._rank] = _float32_numpy(accumulate[0]), _float32_numpy(accumulate[1])
            results = engine.backward(*arrays, grad_out, True, acc13, acc2)
        self.backward_calls += 1
        gx, gs, g13, g2 = results[self._rank]
        grad_x = torch.from_numpy(gx).to(torch.bfloat16)
        grad_scores = torch.from_numpy(gs).to(scores_TK.dtype)
        if accumulate is not None:
            return grad_x, grad_scores, _write_back(accumulate[0], g13), _write_back(accumulate[1], g2)
        # Without accumulation the weight grads come in the weights' dtype, as from the GPU engine.
        return grad_x, grad_scores, _from_numpy(g13, w13.dtype, w13.shape), _from_numpy(g2, w2.dtype, w2.shape)


class VirtualRanksEngine(LatestForward):
    """Runs a CPU virtual-ranks Context's calls (every rank in this process) on an ``Engine``.

    The interface of the CUDA engine's virtual ranks: one (x_TD, ids_TK, scores_TK, w13, w2) tuple
    per rank. Like ContextEngine, a backward whose forward was not the last one recomputes it first.
    """

    def __init__(self, context: Any):
        self._engine = Engine(context.config, context.ep_size)
        super().__init__()

    def _forward(self, ranks: Sequence[tuple], w13_layout: str) -> list[torch.Tensor]:
        return self._engine.forward(*[list(column) for column in zip(*ranks)], w13_layout=w13_layout)

    @staticmethod
    def _key(ranks: Sequence[tuple], w13_layout: str) -> tuple:
        return (w13_layout, call_identity([t for inputs in ranks for t in inputs]))

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
